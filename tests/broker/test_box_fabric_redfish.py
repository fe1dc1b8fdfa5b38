"""RedfishBoxFabric (the broker's fence and scrub) against the local Redfish fabric
service over HTTPS: the service the agent-side Redfish mapper is tested against."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest

from dxpool.broker.box_fabric import BoxFabricError
from dxpool.broker.box_fabric_redfish import RedfishBoxFabric
from dxpool.names import GpuRef
from dxpool.redfish.fabric_map import RedfishFabricMap
from dxpool.redfish.session import RedfishLoginError, RedfishUnreachableError
from tests.hostagent.redfish_service import (
    RedfishFabricService,
    install,
    running_service,
    self_signed_cert,
)
from tests.hostagent.test_redfish import fabric_map

GPU0 = GpuRef("b1", 0)
GPU1 = GpuRef("b1", 1)
ZONES = "/redfish/v1/Fabrics/PCIe/Zones"


@pytest.fixture(scope="module")
def tls(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    return self_signed_cert(tmp_path_factory.mktemp("tls"))


@pytest.fixture
def service(tls: tuple[Path, Path]) -> Iterator[RedfishFabricService]:
    fabric = RedfishFabricService()
    install(fabric)
    with running_service(fabric, tls=tls) as running:
        yield running


@pytest.fixture
def fmap(service: RedfishFabricService, tls: tuple[Path, Path]) -> RedfishFabricMap:
    return fabric_map(service, tls[0])


@pytest.fixture
def box(fmap: RedfishFabricMap) -> Iterator[RedfishBoxFabric]:
    built = RedfishBoxFabric(fmap, retry_wait_s=0)
    yield built
    built.close()


# -- fence ----------------------------------------------------------------------------------


def test_fence_removes_the_gpu_from_every_zone_that_holds_it(
    service: RedfishFabricService, box: RedfishBoxFabric
) -> None:
    service.set_zone("h1-s0", ["HostPort-h1", "GPU-b1-0"])
    service.set_zone("h2-s0", ["HostPort-h2", "GPU-b1-1"])  # another GPU, another host
    service.add_zone("by-hand", ["HostPort-h1", "HostPort-h2", "GPU-b1-0"])

    box.fence(GPU0, generation=4)

    assert service.zone("h1-s0") == ["HostPort-h1"]  # the host port stays
    assert service.zone("by-hand") == ["HostPort-h1", "HostPort-h2"]
    assert service.zone("h2-s0") == ["HostPort-h2", "GPU-b1-1"]  # untouched
    patched = sorted(path.rpartition("/")[2] for path, _ in service.patches())
    assert patched == ["by-hand", "h1-s0"]
    assert all(etag for _, etag in service.patches())  # every write was conditional


def test_fence_of_an_unmapped_gpu_writes_nothing_and_is_idempotent(
    service: RedfishFabricService, box: RedfishBoxFabric
) -> None:
    box.fence(GPU0, generation=1)
    service.set_zone("h1-s1", ["HostPort-h1", "GPU-b1-0"])
    box.fence(GPU0, generation=1)
    box.fence(GPU0, generation=1)

    assert service.zone("h1-s1") == ["HostPort-h1"]
    assert len(service.patches()) == 1


def test_fence_rereads_a_zone_that_changed_underneath(
    service: RedfishFabricService, box: RedfishBoxFabric
) -> None:
    service.set_zone("h1-s0", ["HostPort-h1", "GPU-b1-0"])  # ETag h1-s0-2
    # Between the fence's read and its write, the lost host's agent (still running)
    # maps a second GPU into the same zone: the write's If-Match fails (412), the fresh
    # read removes GPU 0 and leaves GPU 3, which is not being fenced.
    service.before_patch(lambda: service.set_zone("h1-s0", ["HostPort-h1", "GPU-b1-0", "GPU-b1-3"]))

    box.fence(GPU0, generation=2)

    assert service.zone("h1-s0") == ["HostPort-h1", "GPU-b1-3"]
    assert [etag for _, etag in service.patches()] == ['"h1-s0-2"', '"h1-s0-3"']


def test_a_zone_deleted_underneath_holds_nothing(
    service: RedfishFabricService, box: RedfishBoxFabric
) -> None:
    service.set_zone("h1-s0", ["HostPort-h1", "GPU-b1-0"])
    service.add_zone("by-hand", ["HostPort-h2", "GPU-b1-0"])
    # An operator deletes the hand-made zone between the fence's read of it and its
    # write (the zones are written in the service's order: by-hand first): the write is
    # answered 404, and the zone, gone, holds nothing.
    service.before_patch(lambda: service.remove_zone("by-hand"))

    box.fence(GPU0, generation=1)

    assert service.zone("h1-s0") == ["HostPort-h1"]
    assert [path.rpartition("/")[2] for path, _ in service.patches()] == ["by-hand", "h1-s0"]
    assert "by-hand" not in service.state.zones


def test_a_late_fence_cannot_tell_generations_apart(
    service: RedfishFabricService, box: RedfishBoxFabric
) -> None:
    # Zones carry no generation: a fence for generation 3 that arrives after the GPU
    # was given to a newer assignment removes that mapping too. It fails safe - the
    # newer host loses the device, no one else gains it - and the broker never fences a
    # GPU that is not FENCING for that generation (see the module's docstring).
    service.set_zone("h2-s0", ["HostPort-h2", "GPU-b1-0"])

    box.fence(GPU0, generation=3)

    assert service.zone("h2-s0") == ["HostPort-h2"]


def test_fence_reads_back_and_removes_a_map_that_slipped_in_after_its_write(
    service: RedfishFabricService, box: RedfishBoxFabric
) -> None:
    service.set_zone("h1-s0", ["HostPort-h1", "GPU-b1-0"])
    # The write lands; right after it, someone maps the GPU into another zone. The
    # read-back sees it and removes it there too before the fence returns.
    original = service.patch_zone

    def patch_then_remap(path: str, body: object, if_match: str) -> tuple[int, dict[str, object]]:
        answer = original(path, body, if_match)
        if path.endswith("/h1-s0"):
            service.set_zone("h2-s0", ["HostPort-h2", "GPU-b1-0"])
        return answer

    service.patch_zone = patch_then_remap  # type: ignore[method-assign]

    box.fence(GPU0, generation=1)

    assert service.zone("h1-s0") == ["HostPort-h1"]
    assert service.zone("h2-s0") == ["HostPort-h2"]


def test_a_gpu_that_keeps_coming_back_fails_the_fence(
    service: RedfishFabricService, fmap: RedfishFabricMap
) -> None:
    box = RedfishBoxFabric(replace(fmap, service=replace(fmap.service, attempts=2)), retry_wait_s=0)
    original = service.patch_zone

    def undone(path: str, body: object, if_match: str) -> tuple[int, dict[str, object]]:
        answer = original(path, body, if_match)
        service.set_zone("h1-s0", ["HostPort-h1", "GPU-b1-0"])  # mapped again at once
        return answer

    service.set_zone("h1-s0", ["HostPort-h1", "GPU-b1-0"])
    service.patch_zone = undone  # type: ignore[method-assign]

    with pytest.raises(BoxFabricError, match=r"still in zone\(s\) h1-s0 .* after 2 rounds"):
        box.fence(GPU0, generation=1)
    box.close()


def test_a_409_fails_the_fence_with_the_services_words(
    service: RedfishFabricService, box: RedfishBoxFabric
) -> None:
    service.set_zone("h1-s0", ["HostPort-h1", "GPU-b1-0"])
    service.fail("PATCH", "/Zones/h1-s0", 409)

    with pytest.raises(BoxFabricError) as raised:
        box.fence(GPU0, generation=1)

    assert "answered 409 to PATCH" in raised.value.args[0]
    assert "injected failure" in raised.value.args[0]
    assert len(service.patches()) == 1  # a conflict is not retried within the call
    assert service.zone("h1-s0") == ["HostPort-h1", "GPU-b1-0"]
    box.fence(GPU0, generation=1)  # the broker's next pass
    assert service.zone("h1-s0") == ["HostPort-h1"]


def test_server_errors_are_retried_within_the_fence(
    service: RedfishFabricService, box: RedfishBoxFabric
) -> None:
    service.set_zone("h1-s0", ["HostPort-h1", "GPU-b1-0"])
    service.fail("PATCH", "/Zones/h1-s0", 503, count=2)

    box.fence(GPU0, generation=1)

    assert service.zone("h1-s0") == ["HostPort-h1"]
    assert len(service.patches()) == 3


def test_server_errors_past_the_attempts_fail_the_fence(
    service: RedfishFabricService, box: RedfishBoxFabric
) -> None:
    service.fail("GET", "/Zones", 500, count=3)
    with pytest.raises(BoxFabricError, match=r"answered 500 to GET .*/Zones"):
        box.fence(GPU0, generation=1)


def test_a_timed_out_write_that_took_effect_is_found_by_the_next_read(
    service: RedfishFabricService, box: RedfishBoxFabric
) -> None:
    service.set_zone("h1-s0", ["HostPort-h1", "GPU-b1-0"])
    service.delay("PATCH", "/Zones/h1-s0", 1.0)  # applied, answered after the 0.5 s timeout

    box.fence(GPU0, generation=1)

    assert service.zone("h1-s0") == ["HostPort-h1"]
    assert len(service.patches()) == 1


def test_a_service_that_never_answers_fails_the_fence_as_unreachable(
    service: RedfishFabricService, box: RedfishBoxFabric
) -> None:
    service.delay("GET", "/Zones", 1.0, count=3)
    with pytest.raises(BoxFabricError, match=r"did not answer GET .* in time") as raised:
        box.fence(GPU0, generation=1)
    assert isinstance(raised.value.__cause__, RedfishUnreachableError)


def test_wrong_credentials_fail_every_call_and_say_what_to_fix(
    service: RedfishFabricService, fmap: RedfishFabricMap
) -> None:
    service.set_zone("h1-s0", ["HostPort-h1", "GPU-b1-0"])
    box = RedfishBoxFabric(replace(fmap, service=replace(fmap.service, password="nope")))

    for _ in range(2):  # the login is tried again on the next call
        with pytest.raises(BoxFabricError, match="refused the credentials") as raised:
            box.fence(GPU0, generation=1)
        assert isinstance(raised.value.__cause__, RedfishLoginError)
    assert service.zone("h1-s0") == ["HostPort-h1", "GPU-b1-0"]
    assert len([r for r in service.requests if r[0] == "POST"]) == 2


def test_an_expired_session_logs_in_again(
    service: RedfishFabricService, box: RedfishBoxFabric
) -> None:
    box.fence(GPU0, generation=1)
    service.expire_sessions()
    service.set_zone("h1-s0", ["HostPort-h1", "GPU-b1-0"])

    box.fence(GPU0, generation=1)

    assert service.zone("h1-s0") == ["HostPort-h1"]


def test_a_gpu_outside_the_map_is_refused_with_the_fix(box: RedfishBoxFabric) -> None:
    with pytest.raises(BoxFabricError, match=r"list it under boxes\.b9"):
        box.fence(GpuRef("b9", 0), generation=1)


def test_a_map_naming_a_wrong_endpoint_fails_instead_of_fencing_nothing(
    service: RedfishFabricService, fmap: RedfishFabricMap
) -> None:
    service.set_zone("h1-s0", ["HostPort-h1", "GPU-b1-0"])
    typo = RedfishBoxFabric(replace(fmap, boxes={"b1": ("GPU-b1-O", "GPU-b1-1")}))
    with pytest.raises(BoxFabricError, match=r"names endpoint GPU-b1-O for .* does not have"):
        typo.fence(GPU0, generation=1)
    typo.close()
    host_port = RedfishBoxFabric(
        replace(fmap, hosts={"h1": fmap.hosts["h1"]}, boxes={"b1": ("HostPort-h2",)})
    )
    with pytest.raises(BoxFabricError, match="has EntityRole Initiator, not Target"):
        host_port.fence(GPU0, generation=1)
    host_port.close()
    assert service.zone("h1-s0") == ["HostPort-h1", "GPU-b1-0"]
    assert service.zone("h2-s0") == ["HostPort-h2"]


def test_nothing_is_sent_before_the_first_call(
    service: RedfishFabricService, fmap: RedfishFabricMap
) -> None:
    box = RedfishBoxFabric(fmap)
    assert service.requests == []
    box.close()  # no session to end
    assert service.requests == []


def test_close_ends_the_session(service: RedfishFabricService, box: RedfishBoxFabric) -> None:
    box.fence(GPU0, generation=1)
    assert len(service.state.sessions) == 1
    box.close()
    assert service.state.sessions == {}


# -- scrub ----------------------------------------------------------------------------------


def test_scrub_resets_the_gpu_through_its_processor(
    service: RedfishFabricService, box: RedfishBoxFabric
) -> None:
    box.scrub(GPU1, generation=3)
    assert service.resets == [("GPU-b1-1", "ForceRestart")]


def test_scrub_follows_a_task_to_its_end(tls: tuple[Path, Path]) -> None:
    fabric = RedfishFabricService(async_resets=True)
    install(fabric)
    with running_service(fabric, tls=tls):
        box = RedfishBoxFabric(fabric_map(fabric, tls[0]), retry_wait_s=0)
        box.scrub(GPU0, generation=1)
        box.close()
    task_polls = [p for m, p, _ in fabric.requests if m == "GET" and "/TaskService/" in p]
    assert len(task_polls) == 3  # Running, Running, Completed
    assert fabric.resets == [("GPU-b1-0", "ForceRestart")]


def test_scrub_refuses_a_gpu_still_in_a_zone(
    service: RedfishFabricService, box: RedfishBoxFabric
) -> None:
    service.set_zone("h2-s0", ["HostPort-h2", "GPU-b1-0"])
    with pytest.raises(BoxFabricError, match=r"still in zone\(s\) h2-s0 .* fenced before"):
        box.scrub(GPU0, generation=1)
    assert service.resets == []


def test_scrub_without_a_reset_action_fails_and_says_so(tls: tuple[Path, Path]) -> None:
    fabric = RedfishFabricService(resets=False)
    install(fabric)
    with running_service(fabric, tls=tls):
        box = RedfishBoxFabric(fabric_map(fabric, tls[0]), retry_wait_s=0)
        with pytest.raises(BoxFabricError, match="cannot be reset at the box side") as raised:
            box.scrub(GPU0, generation=1)
        box.close()
    assert "Processors/GPU-b1-0" in raised.value.args[0]
    assert "hook:PATH" in raised.value.args[0]


def test_a_failed_reset_is_reported(service: RedfishFabricService, box: RedfishBoxFabric) -> None:
    service.fail("POST", "/Processor.Reset", 500)
    with pytest.raises(BoxFabricError, match="answered 500 to POST"):
        box.scrub(GPU0, generation=1)
    assert service.resets == []
    box.scrub(GPU0, generation=1)
    assert service.resets == [("GPU-b1-0", "ForceRestart")]


def test_fence_and_scrub_from_several_threads(
    service: RedfishFabricService, box: RedfishBoxFabric
) -> None:
    service.set_zone("h1-s0", ["HostPort-h1", "GPU-b1-0"])
    service.set_zone("h1-s1", ["HostPort-h1", "GPU-b1-1"])
    errors: list[BaseException] = []

    def reclaim(gpu: GpuRef) -> None:
        try:
            box.fence(gpu, generation=1)
            box.scrub(gpu, generation=1)
        except BaseException as error:
            errors.append(error)

    threads = [threading.Thread(target=reclaim, args=(gpu,)) for gpu in (GPU0, GPU1)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()

    assert errors == []
    assert service.zone("h1-s0") == service.zone("h1-s1") == ["HostPort-h1"]
    assert sorted(service.resets) == [("GPU-b1-0", "ForceRestart"), ("GPU-b1-1", "ForceRestart")]
