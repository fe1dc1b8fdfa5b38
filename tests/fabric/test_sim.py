"""The simulated fabric behaves like proxy hardware, and its state is shared safely."""

from __future__ import annotations

import json
import multiprocessing
import re
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import pytest

from dxpool.fabric.sim import (
    Fenced,
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

H100 = SimGpuSpec("H100", 81_559)
A100 = SimGpuSpec("A100", 40_960, "10de:20b1")


@pytest.fixture
def fabric(tmp_path: Path) -> SimFabric:
    return SimFabric.create(
        tmp_path / "fabric",
        boxes={"b1": [H100] * 4, "b2": [A100, A100]},
        hosts={"h1": 4, "h2": 2},
    )


def attach(fabric: SimFabric, box: str, slot: int, host: str, host_slot: int) -> SimDevice:
    fabric.map(box, slot, host, host_slot)
    fabric.rescan(host)
    [device] = [d for d in fabric.devices(host) if d.host_slot == host_slot]
    return device


# installation -------------------------------------------------------------------------


def test_create_then_open_from_another_handle(fabric: SimFabric) -> None:
    other = SimFabric(fabric.state_dir)
    assert other.boxes() == {"b1": [H100] * 4, "b2": [A100, A100]}
    assert other.hosts() == {"h1": 4, "h2": 2}
    assert other.devices("h1") == []
    assert other.mappings("h1") == {}


def test_opening_a_directory_without_a_fabric_fails(tmp_path: Path) -> None:
    with pytest.raises(UnknownTarget, match="no simulated fabric"):
        SimFabric(tmp_path)


def test_create_replaces_an_existing_fabric(fabric: SimFabric) -> None:
    fabric.map("b1", 0, "h1", 0)
    SimFabric.create(fabric.state_dir, boxes={"b9": [H100]}, hosts={"h9": 1})
    assert fabric.boxes() == {"b9": [H100]}
    assert fabric.hosts() == {"h9": 1}


def test_add_box_and_host_are_idempotent_when_identical(fabric: SimFabric) -> None:
    fabric.add_box("b1", [H100] * 4)
    fabric.add_host("h1", 4)
    fabric.add_box("b3", [H100, A100])
    fabric.add_host("h3", 8)
    assert fabric.boxes()["b3"] == [H100, A100]
    assert fabric.hosts()["h3"] == 8
    with pytest.raises(SimFabricError, match="already installed with other GPUs"):
        fabric.add_box("b1", [A100])
    with pytest.raises(SimFabricError, match="already installed with 4 proxy slots, not 2"):
        fabric.add_host("h1", 2)


@pytest.mark.parametrize(
    ("call", "fragment"),
    [
        (lambda f: f.add_box("Box_1", [H100]), "invalid box id"),
        (lambda f: f.add_box("b5", []), "at least one GPU"),
        (lambda f: f.add_host("h5", 0), "proxy slot count must be an integer 1-191"),
        (lambda f: f.add_host("h5", 500), "1-191"),
        (lambda f: f.add_host("-h", 1), "invalid host id"),
    ],
)
def test_bad_installation_is_refused(
    fabric: SimFabric, call: Callable[[SimFabric], object], fragment: str
) -> None:
    with pytest.raises(SimFabricError, match=fragment):
        call(fabric)


def test_gpu_specs_and_delays_are_validated() -> None:
    with pytest.raises(SimFabricError, match="memory_mib must be positive"):
        SimGpuSpec("H100", 0)
    with pytest.raises(SimFabricError, match="lowercase hex"):
        SimGpuSpec("H100", 1, "10DE-2330")
    with pytest.raises(SimFabricError, match="model name"):
        SimGpuSpec("", 1)
    with pytest.raises(SimFabricError, match="must not be negative"):
        SimDelays(map_s=-1)


# mapping tables ----------------------------------------------------------------------


def test_a_device_appears_only_after_map_and_rescan(fabric: SimFabric) -> None:
    fabric.rescan("h1")
    assert fabric.devices("h1") == []
    fabric.map("b1", 2, "h1", 1)
    assert fabric.mapping("b1", 2) == ("h1", 1)
    assert fabric.mappings("h1") == {1: ("b1", 2)}
    assert fabric.devices("h1") == []
    fabric.rescan("h1")
    assert fabric.devices("h1") == [SimDevice("0000:42:00.0", "b1", 2, 1, "nvidia")]
    fabric.rescan("h1")  # idempotent
    assert len(fabric.devices("h1")) == 1
    assert fabric.devices("h2") == []


def test_map_is_idempotent_for_the_identical_mapping(fabric: SimFabric) -> None:
    fabric.map("b1", 0, "h1", 0)
    fabric.map("b1", 0, "h1", 0)
    assert fabric.mappings("h1") == {0: ("b1", 0)}


def test_a_gpu_mapped_elsewhere_cannot_be_mapped_again(fabric: SimFabric) -> None:
    fabric.map("b1", 0, "h1", 0)
    with pytest.raises(MappingConflict, match=r"already mapped to host 'h1' slot 0"):
        fabric.map("b1", 0, "h2", 0)
    with pytest.raises(MappingConflict, match="already mapped"):
        fabric.map("b1", 0, "h1", 1)
    assert fabric.mapping("b1", 0) == ("h1", 0)
    assert fabric.mappings("h2") == {}


def test_a_taken_host_slot_cannot_take_another_gpu(fabric: SimFabric) -> None:
    fabric.map("b1", 0, "h1", 3)
    with pytest.raises(MappingConflict, match="slot 3 of host 'h1' already holds GPU b1/0"):
        fabric.map("b2", 1, "h1", 3)
    assert fabric.mapping("b2", 1) is None


@pytest.mark.parametrize(
    ("args", "fragment"),
    [
        (("b7", 0, "h1", 0), "unknown box 'b7'"),
        (("b1", 4, "h1", 0), "box 'b1' has no slot 4"),
        (("b1", -1, "h1", 0), "no slot -1"),
        (("b1", 0, "h7", 0), "unknown host 'h7'"),
        (("b1", 0, "h2", 2), "host 'h2' has no proxy slot 2"),
    ],
)
def test_map_rejects_unknown_targets(
    fabric: SimFabric, args: tuple[str, int, str, int], fragment: str
) -> None:
    with pytest.raises(UnknownTarget, match=fragment):
        fabric.map(*args)


def test_unmapping_what_was_never_mapped_is_a_no_op(fabric: SimFabric) -> None:
    fabric.unmap("b1", 0, "h1")
    assert fabric.mapping("b1", 0) is None


def test_unmap_never_touches_another_hosts_mapping(fabric: SimFabric) -> None:
    device = attach(fabric, "b1", 0, "h1", 0)
    fabric.unmap("b1", 0, "h2")
    assert fabric.mapping("b1", 0) == ("h1", 0)
    assert fabric.devices("h1") == [device]


def test_unmap_with_the_device_present_is_a_surprise_removal(fabric: SimFabric) -> None:
    attach(fabric, "b1", 0, "h1", 0)
    attach(fabric, "b2", 0, "h1", 1)
    fabric.unmap("b1", 0, "h1")
    assert fabric.mapping("b1", 0) is None
    assert [d.box for d in fabric.devices("h1")] == ["b2"]
    fabric.rescan("h1")  # nothing mapped there any more, so nothing comes back
    assert [d.host_slot for d in fabric.devices("h1")] == [1]


def test_revoke_fences_the_gpu_off_whatever_host_holds_it(fabric: SimFabric) -> None:
    attach(fabric, "b2", 1, "h2", 0)
    fabric.revoke("b2", 1)
    assert fabric.mapping("b2", 1) is None
    assert fabric.devices("h2") == []
    fabric.revoke("b2", 1)  # no-op once revoked
    fabric.map("b2", 1, "h1", 0)  # free for someone else
    assert fabric.mappings("h1") == {0: ("b2", 1)}


def test_lookups_of_unknown_targets_fail(fabric: SimFabric) -> None:
    with pytest.raises(UnknownTarget, match="installed boxes: b1, b2"):
        fabric.mapping("b9", 0)
    with pytest.raises(UnknownTarget, match="installed hosts: h1, h2"):
        fabric.mappings("h9")
    with pytest.raises(UnknownTarget):
        fabric.devices("h9")
    with pytest.raises(UnknownTarget):
        fabric.rescan("h9")
    with pytest.raises(UnknownTarget):
        fabric.unmap("b1", 9, "h1")


# PCIe bus, drivers and identity ------------------------------------------------------


def test_remove_device_keeps_the_mapping_and_rescan_brings_it_back(fabric: SimFabric) -> None:
    device = attach(fabric, "b1", 1, "h1", 2)
    assert device.bdf == "0000:43:00.0"
    fabric.remove_device("h1", device.bdf)
    assert fabric.devices("h1") == []
    assert fabric.mapping("b1", 1) == ("h1", 2)
    fabric.remove_device("h1", device.bdf)  # absent: no-op
    fabric.rescan("h1")
    assert fabric.devices("h1") == [device]


def test_identity_is_what_nvml_reports_and_is_stable(fabric: SimFabric) -> None:
    device = attach(fabric, "b2", 1, "h2", 1)
    identity = fabric.identity("h2", device.bdf)
    assert identity.model == "A100"
    assert identity.memory_mib == 40_960
    assert identity.pci_id == "10de:20b1"
    assert identity.healthy
    assert identity.uuid.startswith("GPU-")
    uuid.UUID(identity.uuid.removeprefix("GPU-"))
    assert len(identity.serial) == 13 and identity.serial.isdigit()
    # the same GPU on another host, another slot, another day: the same identity
    fabric.unmap("b2", 1, "h2")
    moved = attach(fabric, "b2", 1, "h1", 3)
    assert fabric.identity("h1", moved.bdf) == identity
    other = attach(fabric, "b2", 0, "h2", 0)
    assert fabric.identity("h2", other.bdf).uuid != identity.uuid


def test_nvml_cannot_see_a_device_bound_to_vfio_or_unbound(fabric: SimFabric) -> None:
    device = attach(fabric, "b1", 0, "h1", 0)
    fabric.bind("h1", device.bdf, "vfio-pci")
    assert fabric.devices("h1")[0].driver == "vfio-pci"
    with pytest.raises(SimFabricError, match="bound to vfio-pci; NVML sees only") as caught:
        fabric.identity("h1", device.bdf)
    assert not isinstance(caught.value, UnknownTarget)
    fabric.rescan("h1")  # a rescan leaves present devices' drivers alone
    assert fabric.devices("h1")[0].driver == "vfio-pci"
    fabric.bind("h1", device.bdf, None)
    with pytest.raises(SimFabricError, match="not bound to a driver"):
        fabric.identity("h1", device.bdf)
    fabric.bind("h1", device.bdf, "nvidia")
    assert isinstance(fabric.identity("h1", device.bdf), SimIdentity)


def test_bind_and_identity_need_a_present_device(fabric: SimFabric) -> None:
    fabric.map("b1", 0, "h1", 0)  # mapped, but no rescan yet
    with pytest.raises(UnknownTarget, match=re.escape("no PCI device '0000:41:00.0'")):
        fabric.identity("h1", "0000:41:00.0")
    with pytest.raises(UnknownTarget):
        fabric.bind("h1", "0000:41:00.0", "nvidia")
    fabric.rescan("h1")
    with pytest.raises(SimFabricError, match="unknown driver 'nouveau'"):
        fabric.bind("h1", "0000:41:00.0", "nouveau")


def test_health_shows_in_identity_and_survives_reattach(fabric: SimFabric) -> None:
    device = attach(fabric, "b1", 3, "h1", 0)
    fabric.set_health("b1", 3, False)
    assert not fabric.identity("h1", device.bdf).healthy
    fabric.unmap("b1", 3, "h1")
    device = attach(fabric, "b1", 3, "h2", 1)
    assert not fabric.identity("h2", device.bdf).healthy
    fabric.set_health("b1", 3, True)
    assert fabric.identity("h2", device.bdf).healthy


# faults -------------------------------------------------------------------------------


def test_an_injected_fault_fires_count_times_and_the_call_does_nothing(
    fabric: SimFabric,
) -> None:
    fabric.inject_fault("map", host="h1", count=2, message="proxy table write failed")
    fabric.map("b1", 1, "h2", 0)  # another host: not matched
    for _ in range(2):
        with pytest.raises(InjectedFault, match="proxy table write failed"):
            fabric.map("b1", 0, "h1", 0)
        assert fabric.mapping("b1", 0) is None
    fabric.map("b1", 0, "h1", 0)
    assert fabric.mapping("b1", 0) == ("h1", 0)


def test_faults_match_box_and_slot_of_the_addressed_device(fabric: SimFabric) -> None:
    first = attach(fabric, "b1", 0, "h1", 0)
    second = attach(fabric, "b1", 1, "h1", 1)
    fabric.inject_fault("identity", box="b1", slot=1)
    fabric.inject_fault("bind", box="b1")
    fabric.identity("h1", first.bdf)
    with pytest.raises(InjectedFault):
        fabric.identity("h1", second.bdf)
    fabric.identity("h1", second.bdf)
    with pytest.raises(InjectedFault):
        fabric.bind("h1", first.bdf, "vfio-pci")
    assert fabric.devices("h1")[0].driver == "nvidia"


def test_unmap_and_rescan_faults(fabric: SimFabric) -> None:
    fabric.map("b1", 0, "h1", 0)
    fabric.inject_fault("rescan", host="h1")
    fabric.inject_fault("unmap")
    with pytest.raises(InjectedFault):
        fabric.rescan("h1")
    assert fabric.devices("h1") == []
    with pytest.raises(InjectedFault):
        fabric.unmap("b1", 0, "h1")
    assert fabric.mapping("b1", 0) == ("h1", 0)


def test_clear_faults_drops_pending_faults(fabric: SimFabric) -> None:
    fabric.inject_fault("map", count=5)
    fabric.clear_faults()
    fabric.map("b1", 0, "h1", 0)


@pytest.mark.parametrize(
    ("kwargs", "error", "fragment"),
    [
        ({"op": "explode"}, SimFabricError, "unknown fault op 'explode'"),
        ({"op": "rescan", "box": "b1"}, SimFabricError, "host only"),
        ({"op": "map", "count": 0}, SimFabricError, "positive integer"),
        ({"op": "map", "host": "h9"}, UnknownTarget, "unknown host"),
        ({"op": "map", "box": "b1", "slot": 9}, UnknownTarget, "no slot 9"),
    ],
)
def test_bad_faults_are_refused(
    fabric: SimFabric, kwargs: dict[str, object], error: type[Exception], fragment: str
) -> None:
    with pytest.raises(error, match=fragment):
        fabric.inject_fault(**kwargs)  # type: ignore[arg-type]


# sharing between processes --------------------------------------------------------------

INJECT_FROM_CHILD = """
import sys
from pathlib import Path
from dxpool.fabric.sim import InjectedFault, SimFabric

fabric = SimFabric(Path(sys.argv[1]))
fabric.inject_fault("map", box="b2", message="injected by the test process")
try:
    fabric.identity("h1", "0000:41:00.0")
except InjectedFault as error:
    print("hit:", error)
"""


def test_faults_injected_in_one_process_are_hit_in_another(fabric: SimFabric) -> None:
    attach(fabric, "b1", 0, "h1", 0)
    fabric.inject_fault("identity", host="h1", message="nvml timed out")
    result = subprocess.run(
        [sys.executable, "-c", INJECT_FROM_CHILD, str(fabric.state_dir)],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    assert result.stdout.strip() == "hit: nvml timed out"  # our fault, hit over there
    with pytest.raises(InjectedFault, match="injected by the test process"):
        fabric.map("b2", 0, "h2", 0)  # their fault, hit over here
    fabric.map("b2", 0, "h2", 0)


def _map_slots(state_dir: Path, slots: list[int], start: threading.Barrier) -> None:
    fabric = SimFabric(state_dir)
    start.wait(timeout=30)
    for slot in slots:
        fabric.map("big", slot, "wide", slot)
        fabric.rescan("wide")
        fabric.set_health("big", slot, slot % 2 == 0)


def test_concurrent_processes_never_lose_an_update(tmp_path: Path) -> None:
    workers, per_worker = 4, 8
    total = workers * per_worker
    fabric = SimFabric.create(
        tmp_path / "shared", boxes={"big": [H100] * total}, hosts={"wide": total}
    )
    context = multiprocessing.get_context("fork")
    start = context.Barrier(workers)
    processes = [
        context.Process(
            target=_map_slots,
            args=(fabric.state_dir, list(range(w, total, workers)), start),
        )
        for w in range(workers)
    ]
    for process in processes:
        process.start()
    for process in processes:
        process.join(timeout=60)
        assert process.exitcode == 0
    assert fabric.mappings("wide") == {slot: ("big", slot) for slot in range(total)}
    assert [d.host_slot for d in fabric.devices("wide")] == list(range(total))
    healthy = [fabric.identity("wide", d.bdf).healthy for d in fabric.devices("wide")]
    assert healthy == [slot % 2 == 0 for slot in range(total)]
    leftovers = [p.name for p in fabric.state_dir.iterdir() if p.name.endswith(".tmp")]
    assert leftovers == []


def test_delays_belong_to_the_process_and_do_not_hold_the_lock(fabric: SimFabric) -> None:
    slow = SimFabric(fabric.state_dir, SimDelays(hotplug_s=0.5))
    fabric.map("b1", 0, "h1", 0)
    finished: dict[str, float] = {}

    def slow_rescan() -> None:
        slow.rescan("h1")
        finished["rescan"] = time.monotonic()

    started = time.monotonic()
    thread = threading.Thread(target=slow_rescan)
    thread.start()
    time.sleep(0.05)
    fabric.map("b1", 1, "h1", 1)  # not delayed, and not blocked by the sleeping rescan
    finished["map"] = time.monotonic()
    thread.join(timeout=10)
    assert finished["rescan"] - started >= 0.5
    assert finished["map"] < finished["rescan"]
    assert len(fabric.devices("h1")) == 2
    assert SimFabric(fabric.state_dir).delays == SimDelays()


def test_the_state_is_one_json_document_and_corruption_is_reported(fabric: SimFabric) -> None:
    attach(fabric, "b1", 0, "h1", 0)
    document = json.loads((fabric.state_dir / "fabric.json").read_text())
    assert document["mappings"] == [
        {"box": "b1", "slot": 0, "host": "h1", "host_slot": 0, "generation": 0}
    ]
    (fabric.state_dir / "fabric.json").write_text("{not json")
    with pytest.raises(SimFabricError, match="is corrupt"):
        fabric.devices("h1")
    (fabric.state_dir / "fabric.json").write_text('{"format": "something-else"}')
    with pytest.raises(SimFabricError, match="is corrupt"):
        fabric.map("b1", 0, "h1", 0)


def test_fence_drops_mappings_of_its_generation_and_refuses_them_later(fabric: SimFabric) -> None:
    fabric.map("b1", 0, "h1", 0, generation=4)
    fabric.rescan("h1")

    assert fabric.fence("b1", 0, 4) is True
    assert fabric.mapping("b1", 0) is None
    assert fabric.devices("h1") == []  # the host lost the device with the mapping
    with pytest.raises(Fenced):
        fabric.map("b1", 0, "h1", 0, generation=4)  # a stale agent's late map
    assert fabric.fence("b1", 0, 4) is False  # idempotent
    fabric.map("b1", 0, "h2", 1, generation=5)  # the next assignment maps fine
    assert fabric.mapping("b1", 0) == ("h2", 1)


def test_a_stale_fence_leaves_a_newer_assignment_alone(fabric: SimFabric) -> None:
    fabric.map("b1", 0, "h2", 1, generation=6)

    assert fabric.fence("b1", 0, 5) is False  # e.g. from a deposed leader
    assert fabric.mapping("b1", 0) == ("h2", 1)
    assert fabric.fenced_generation("b1", 0) == 5


def test_fence_host_drops_only_that_hosts_mappings_and_refuses_their_generations(
    fabric: SimFabric,
) -> None:
    fabric.map("b1", 0, "h1", 0, generation=3)
    fabric.map("b1", 1, "h1", 2, generation=7)
    fabric.map("b2", 0, "h2", 0, generation=2)
    fabric.rescan("h1")
    fabric.rescan("h2")

    assert fabric.fence_host("h1") == [("b1", 0), ("b1", 1)]

    assert fabric.mappings("h1") == {}
    assert fabric.devices("h1") == []
    assert fabric.mappings("h2") == {0: ("b2", 0)}  # another host is untouched
    assert [d.bdf for d in fabric.devices("h2")] != []
    with pytest.raises(Fenced):
        fabric.map("b1", 1, "h1", 2, generation=7)  # the fenced host's agent, late
    fabric.map("b1", 1, "h2", 1, generation=8)  # the GPU's next assignment
    assert fabric.fence_host("h1") == []  # idempotent


def test_fence_host_faults_and_unknown_hosts(fabric: SimFabric) -> None:
    fabric.map("b1", 0, "h1", 0)
    fabric.inject_fault("fence", host="h1")
    with pytest.raises(InjectedFault):
        fabric.fence_host("h1")
    assert fabric.mapping("b1", 0) == ("h1", 0)  # a faulted call does nothing
    with pytest.raises(UnknownTarget):
        fabric.fence_host("h9")


def test_scrub_is_refused_while_mapped_and_recorded_once_fenced(fabric: SimFabric) -> None:
    fabric.map("b1", 0, "h1", 0, generation=2)
    with pytest.raises(MappingConflict):
        fabric.scrub("b1", 0, 2)
    assert fabric.scrubbed_generation("b1", 0) == -1

    fabric.fence("b1", 0, 2)
    fabric.scrub("b1", 0, 2)
    assert fabric.scrubbed_generation("b1", 0) == 2


def test_fence_and_scrub_faults_can_be_injected(fabric: SimFabric) -> None:
    fabric.inject_fault("fence", box="b1", slot=0)
    fabric.inject_fault("scrub", box="b1", slot=0)
    with pytest.raises(InjectedFault):
        fabric.fence("b1", 0, 1)
    assert fabric.fenced_generation("b1", 0) == -1
    fabric.fence("b1", 0, 1)
    with pytest.raises(InjectedFault):
        fabric.scrub("b1", 0, 1)
