"""RedfishBoxFabric (the broker's fence and scrub) against the local Redfish fabric
service over HTTPS: the service the agent-side Redfish mapper is tested against, which by
default behaves as DMTF's standard allows (zone actions, read-only ``Links.Endpoints``,
no 409 for a second zone, resets answered 202 with empty-body task monitors)."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from dxpool.broker.control.box_fabric import BoxFabricError
from dxpool.broker.control.box_fabric_redfish import RedfishBoxFabric
from dxpool.names import GpuRef
from dxpool.redfish.fabric_map import RedfishFabricMap, RedfishScrub, ResetAction, ZoneLookup
from dxpool.redfish.session import RedfishLoginError, RedfishUnreachableError
from tests.hostagent.redfish_service import (
    MONITORS,
    ZONES,
    RedfishFabricService,
    Write,
    install,
    running_service,
    self_signed_cert,
)
from tests.hostagent.test_redfish import fabric_map

GPU0 = GpuRef("b1", 0)
GPU1 = GpuRef("b1", 1)


@pytest.fixture(scope="module")
def tls(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    return self_signed_cert(tmp_path_factory.mktemp("tls"))


@pytest.fixture
def serve(tls: tuple[Path, Path]) -> Iterator[Any]:
    """Start a service (installed, over HTTPS) and a box fabric on it; both end with the
    test. Returns (service, box fabric)."""
    stack: list[Any] = []
    boxes: list[RedfishBoxFabric] = []

    def start(
        service: RedfishFabricService | None = None, **options: Any
    ) -> tuple[RedfishFabricService, RedfishBoxFabric]:
        fabric = service or RedfishFabricService()
        install(fabric)
        context = running_service(fabric, tls=tls)
        stack.append(context)
        context.__enter__()
        scrub = options.pop("scrub", None)
        fmap = fabric_map(fabric, tls[0], **options)
        if scrub is not None:
            fmap = replace(fmap, scrub=scrub)
        box = RedfishBoxFabric(fmap, retry_wait_s=0)
        boxes.append(box)
        return fabric, box

    yield start
    for box in boxes:
        box.close()
    for context in reversed(stack):
        context.__exit__(None, None, None)


@pytest.fixture
def service_and_box(serve: Any) -> tuple[RedfishFabricService, RedfishBoxFabric]:
    started: tuple[RedfishFabricService, RedfishBoxFabric] = serve()
    return started


@pytest.fixture
def service(service_and_box: tuple[RedfishFabricService, RedfishBoxFabric]) -> RedfishFabricService:
    return service_and_box[0]


@pytest.fixture
def box(service_and_box: tuple[RedfishFabricService, RedfishBoxFabric]) -> RedfishBoxFabric:
    return service_and_box[1]


@pytest.fixture
def fmap(service: RedfishFabricService, tls: tuple[Path, Path]) -> RedfishFabricMap:
    return fabric_map(service, tls[0])


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
    writes = service.writes()
    assert sorted((w.zone, w.kind, w.endpoint) for w in writes) == [
        ("by-hand", "remove", "GPU-b1-0"),
        ("h1-s0", "remove", "GPU-b1-0"),
    ]
    assert all(w.etag for w in writes)  # every change was conditional on the zone's ETag
    assert service.patches() == []


def test_fence_leaves_endpoints_that_are_not_gpus_in_the_zone(
    service: RedfishFabricService, box: RedfishBoxFabric
) -> None:
    # DMTF's CXL mockups put the switch's endpoint in every zone; a memory device may
    # share the host's zone. Neither is a GPU of the map: both stay.
    service.add_endpoint("Switch", "Target")
    service.add_endpoint("Memory", "Target")
    service.set_zone("h1-s0", ["HostPort-h1", "GPU-b1-0", "Switch", "Memory"])

    box.fence(GPU0, generation=1)

    assert service.zone("h1-s0") == ["HostPort-h1", "Switch", "Memory"]


def test_fence_of_an_unmapped_gpu_writes_nothing_and_is_idempotent(
    service: RedfishFabricService, box: RedfishBoxFabric
) -> None:
    box.fence(GPU0, generation=1)
    service.set_zone("h1-s1", ["HostPort-h1", "GPU-b1-0"])
    box.fence(GPU0, generation=1)
    box.fence(GPU0, generation=1)

    assert service.zone("h1-s1") == ["HostPort-h1"]
    assert len(service.writes()) == 1


def test_fence_rereads_a_zone_that_changed_underneath(
    service: RedfishFabricService, box: RedfishBoxFabric
) -> None:
    service.set_zone("h1-s0", ["HostPort-h1", "GPU-b1-0"])  # ETag h1-s0-2
    # Between the fence's read and its write, the lost host's agent (still running)
    # maps a second GPU into the same zone: the ZoneETag is stale (412), the fresh read
    # removes GPU 0 and leaves GPU 3, which is not being fenced.
    service.before_write(lambda: service.set_zone("h1-s0", ["HostPort-h1", "GPU-b1-0", "GPU-b1-3"]))

    box.fence(GPU0, generation=2)

    assert service.zone("h1-s0") == ["HostPort-h1", "GPU-b1-3"]
    assert [w.etag for w in service.writes()] == ['"h1-s0-2"', '"h1-s0-3"']


def test_a_zone_deleted_underneath_holds_nothing(
    service: RedfishFabricService, box: RedfishBoxFabric
) -> None:
    service.set_zone("h1-s0", ["HostPort-h1", "GPU-b1-0"])
    service.add_zone("by-hand", ["HostPort-h2", "GPU-b1-0"])
    # An operator deletes the hand-made zone between the fence's read of it and its
    # write (the zones are written in the service's order: by-hand first): the action is
    # answered 404, the zone is read again (404), and, gone, holds nothing.
    service.before_write(lambda: service.remove_zone("by-hand"))

    box.fence(GPU0, generation=1)

    assert service.zone("h1-s0") == ["HostPort-h1"]
    assert [w.zone for w in service.writes()] == ["by-hand", "h1-s0"]
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
    # The removal lands; right after it, someone maps the GPU into another zone. The
    # read-back sees it and removes it there too before the fence returns.
    original = service.zone_action

    def remove_then_remap(path: str, body: Any) -> Any:
        answer = original(path, body)
        if "/h1-s0/" in path:
            service.set_zone("h2-s0", ["HostPort-h2", "GPU-b1-0"])
        return answer

    service.zone_action = remove_then_remap  # type: ignore[method-assign]

    box.fence(GPU0, generation=1)

    assert service.zone("h1-s0") == ["HostPort-h1"]
    assert service.zone("h2-s0") == ["HostPort-h2"]


def test_a_gpu_that_keeps_coming_back_fails_the_fence(
    service: RedfishFabricService, fmap: RedfishFabricMap
) -> None:
    box = RedfishBoxFabric(replace(fmap, service=replace(fmap.service, attempts=2)), retry_wait_s=0)
    original = service.zone_action

    def undone(path: str, body: Any) -> Any:
        answer = original(path, body)
        service.set_zone("h1-s0", ["HostPort-h1", "GPU-b1-0"])  # mapped again at once
        return answer

    service.set_zone("h1-s0", ["HostPort-h1", "GPU-b1-0"])
    service.zone_action = undone  # type: ignore[method-assign]

    with pytest.raises(BoxFabricError, match=r"still in zone\(s\) h1-s0 .* after 2 rounds"):
        box.fence(GPU0, generation=1)
    box.close()


def test_a_409_fails_the_fence_with_the_services_words(
    service: RedfishFabricService, box: RedfishBoxFabric
) -> None:
    service.set_zone("h1-s0", ["HostPort-h1", "GPU-b1-0"])
    service.fail("POST", "/h1-s0/Actions/Zone.RemoveEndpoint", 409)

    with pytest.raises(BoxFabricError) as raised:
        box.fence(GPU0, generation=1)

    assert "answered 409 to POST" in raised.value.args[0]
    assert "injected failure" in raised.value.args[0]
    assert len(service.writes()) == 1  # a conflict is not retried within the call
    assert service.zone("h1-s0") == ["HostPort-h1", "GPU-b1-0"]
    box.fence(GPU0, generation=1)  # the broker's next pass
    assert service.zone("h1-s0") == ["HostPort-h1"]


def test_a_legacy_service_is_fenced_by_a_conditional_patch(serve: Any) -> None:
    service, box = serve(RedfishFabricService.legacy())
    service.set_zone("h1-s0", ["HostPort-h1", "GPU-b1-0"])

    box.fence(GPU0, generation=1)

    assert service.zone("h1-s0") == ["HostPort-h1"]
    assert service.patches() == [(f"{ZONES}/h1-s0", '"h1-s0-2"')]


def test_server_errors_are_retried_within_the_fence(
    service: RedfishFabricService, box: RedfishBoxFabric
) -> None:
    service.set_zone("h1-s0", ["HostPort-h1", "GPU-b1-0"])
    service.fail("POST", "/h1-s0/Actions/Zone.RemoveEndpoint", 503, count=2)

    box.fence(GPU0, generation=1)

    assert service.zone("h1-s0") == ["HostPort-h1"]
    assert len(service.writes()) == 3


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
    # carried out, answered after the 0.5 s timeout
    service.delay("POST", "/h1-s0/Actions/Zone.RemoveEndpoint", 1.0)

    box.fence(GPU0, generation=1)

    assert service.zone("h1-s0") == ["HostPort-h1"]
    assert len(service.writes()) == 1


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
    assert len([r for r in service.requests if r.method == "POST"]) == 2


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


# -- how many requests a fence costs ------------------------------------------------------


def spare_zones(service: RedfishFabricService, count: int) -> None:
    for index in range(count):
        service.add_zone(f"spare-{index}", [])


def test_once_links_zones_proved_current_a_fence_reads_no_other_zone(
    service: RedfishFabricService, box: RedfishBoxFabric
) -> None:
    spare_zones(service, 30)
    service.set_zone("h1-s0", ["HostPort-h1", "GPU-b1-0"])
    box.fence(GPU0, generation=1)  # scans: Links.Zones is not trusted yet
    assert box.zones is not None and box.zones.trusts_endpoint_zones

    service.set_zone("h2-s0", ["HostPort-h2", "GPU-b1-1"])
    before = len(service.requests)
    box.fence(GPU1, generation=1)
    fence = [
        (r.method, r.path.rpartition("/redfish/v1/Fabrics/PCIe/")[2])
        for r in service.requests[before:]
    ]
    assert fence == [
        ("GET", "Endpoints/GPU-b1-1"),  # the role check; Links.Zones = [h2-s0]
        ("GET", "Zones/h2-s0"),  # checked to hold it
        ("GET", "Zones/h2-s0"),  # read for the change's ETag
        ("POST", "Zones/h2-s0/Actions/Zone.RemoveEndpoint"),
        ("GET", "Endpoints/GPU-b1-1"),  # read back: Links.Zones = []
    ]


def test_a_service_with_stale_links_zones_has_every_zone_read(serve: Any) -> None:
    service, box = serve(RedfishFabricService(reverse_links="stale"))
    spare_zones(service, 5)
    service.set_zone("h1-s0", ["HostPort-h1", "GPU-b1-0"])  # Links.Zones still says []
    box.fence(GPU0, generation=1)
    assert service.zone("h1-s0") == ["HostPort-h1"]
    assert box.zones is not None and not box.zones.trusts_endpoint_zones


def test_a_scan_is_one_request_where_the_service_takes_expand(serve: Any) -> None:
    service, box = serve(RedfishFabricService(expand=True), zone_lookup=ZoneLookup.SCAN)
    spare_zones(service, 30)
    service.set_zone("h1-s0", ["HostPort-h1", "GPU-b1-0"])
    box.fence(GPU0, generation=1)
    zone_gets = [r for r in service.requests if r.method == "GET" and r.path.startswith(ZONES)]
    # two scans (before and after the change), each one expanded listing; the zone read
    # once for its ETag
    assert [(r.path.removeprefix(ZONES), r.query) for r in zone_gets] == [
        ("", "$expand=.($levels=1)"),
        ("/h1-s0", ""),
        ("", "$expand=.($levels=1)"),
    ]
    assert service.zone("h1-s0") == ["HostPort-h1"]


# -- scrub ----------------------------------------------------------------------------------


def test_scrub_waits_for_an_empty_body_202_task_monitor_to_end(
    service: RedfishFabricService, box: RedfishBoxFabric
) -> None:
    # The reset is accepted (202, no body); the monitor answers 202 with no body twice
    # more, then the reset's own 200 without a TaskState. Scrub returns only then.
    box.scrub(GPU1, generation=3)
    returned = time.monotonic()

    assert service.resets == [("GPU-b1-1", "ForceRestart")]
    ((endpoint, ended),) = service.resets_done
    assert endpoint == "GPU-b1-1" and ended <= returned
    polls = [r.status for r in service.requests if r.path.startswith(MONITORS)]
    assert polls == [202, 202, 200]


def test_scrub_honours_retry_after(serve: Any) -> None:
    service, box = serve(RedfishFabricService(retry_after=1, task_polls=1))
    started = time.monotonic()
    box.scrub(GPU0, generation=1)
    polls = [r.at for r in service.requests if r.path.startswith(MONITORS)]
    assert len(polls) == 2
    reset = next(r.at for r in service.requests if r.path.endswith("Processor.Reset"))
    assert polls[0] - reset >= 1.0 and polls[1] - polls[0] >= 1.0
    assert time.monotonic() - started >= 2.0


@pytest.mark.parametrize(
    ("outcome", "message"),
    [
        ("failure", "task monitor .* answered 500: .*did not come back from its reset"),
        ("exception", "ended Exception .*reset failed"),
        ("gone", "task monitor .* answered 404"),
    ],
)
def test_a_reset_that_ends_badly_fails_the_scrub(serve: Any, outcome: str, message: str) -> None:
    _, box = serve(RedfishFabricService(task_outcome=outcome))
    with pytest.raises(BoxFabricError, match=message):
        box.scrub(GPU0, generation=1)


def test_a_reset_that_never_ends_fails_at_the_deadline_never_succeeds(serve: Any) -> None:
    service, box = serve(RedfishFabricService(task_outcome="never"), task_timeout_s=1.0)
    with pytest.raises(BoxFabricError, match=r"did not end within 1s \(task monitor"):
        box.scrub(GPU0, generation=1)
    assert service.resets_done == []


def test_a_task_resource_in_place_of_a_monitor_is_polled_until_it_completes(serve: Any) -> None:
    service, box = serve(RedfishFabricService(task_style="task", task_polls=2))
    box.scrub(GPU0, generation=1)
    assert [name for name, _ in service.resets_done] == ["GPU-b1-0"]


def test_a_synchronous_reset_needs_no_monitor(serve: Any) -> None:
    service, box = serve(RedfishFabricService(async_resets=False))
    box.scrub(GPU1, generation=3)
    assert service.resets == [("GPU-b1-1", "ForceRestart")]
    assert not [r for r in service.requests if r.path.startswith(MONITORS)]


def test_scrub_refuses_a_gpu_still_in_a_zone(
    service: RedfishFabricService, box: RedfishBoxFabric
) -> None:
    service.set_zone("h2-s0", ["HostPort-h2", "GPU-b1-0"])
    with pytest.raises(BoxFabricError, match=r"still in zone\(s\) h2-s0 .* fenced before"):
        box.scrub(GPU0, generation=1)
    assert service.resets == []


def test_scrub_without_a_reset_action_says_what_it_looked_for_and_where(serve: Any) -> None:
    _, box = serve(RedfishFabricService(resets=False))
    with pytest.raises(BoxFabricError, match="cannot be reset at the box side") as raised:
        box.scrub(GPU0, generation=1)
    message = raised.value.args[0]
    assert "looked for #Processor.Reset on its endpoint GPU-b1-0" in message
    assert "Processors/GPU-b1-0) at" in message
    assert "found none" in message
    assert "scrub.actions" in message and "scrub.hook" in message


def test_scrub_posts_the_parameters_the_map_names(serve: Any) -> None:
    scrub = RedfishScrub(actions=(ResetAction("#Processor.Reset", {"ResetType": "ForceOff"}),))
    service, box = serve(scrub=scrub)
    box.scrub(GPU0, generation=1)
    assert service.resets == [("GPU-b1-0", "ForceOff")]


def test_scrub_runs_the_hook_where_the_service_offers_no_reset(serve: Any, tmp_path: Path) -> None:
    hook = tmp_path / "scrub-hook"
    record = tmp_path / "scrubbed"
    hook.write_text(f'#!/bin/sh\necho "$@" >> {record}\n')
    hook.chmod(0o755)
    _, box = serve(RedfishFabricService(resets=False), scrub=RedfishScrub(actions=(), hook=hook))
    box.scrub(GPU1, generation=7)
    assert record.read_text() == "scrub-gpu b1 1 7\n"

    hook.write_text("#!/bin/sh\necho 'vendor tool: device busy' >&2\nexit 1\n")
    with pytest.raises(BoxFabricError, match="offers no reset action and the scrub hook failed"):
        box.scrub(GPU1, generation=7)


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


def test_writes_are_logged_with_both_etags(
    service: RedfishFabricService, box: RedfishBoxFabric
) -> None:
    service.set_zone("h1-s0", ["HostPort-h1", "GPU-b1-0"])
    box.fence(GPU0, generation=1)
    assert service.writes() == [Write("h1-s0", "remove", "GPU-b1-0", '"h1-s0-2"', "")]
