"""RedfishProxyMapper against the local Redfish fabric service over HTTPS.

The service behaves as DMTF's standard allows by default (read-only ``Links.Endpoints``,
zone actions, no 409 for a second zone, ETags); tests of older or stricter services say
which option they turn on.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from dxpool.hostagent.drivers.redfish import RedfishProxyMapper, connect_redfish_mapper
from dxpool.hostagent.errors import AttachConflictError, DriverError
from dxpool.names import GpuRef
from dxpool.redfish.fabric_map import (
    AuthMethod,
    Membership,
    RedfishFabricMap,
    RedfishHost,
    RedfishService,
    ZoneLookup,
)
from dxpool.redfish.session import (
    RedfishLoginError,
    RedfishSession,
    RedfishStatusError,
    RedfishUnreachableError,
)

from .redfish_service import (
    FABRIC,
    PASSWORD,
    USERNAME,
    ZONES,
    RedfishFabricService,
    Write,
    install,
    running_service,
    self_signed_cert,
)

GPU0 = GpuRef("b1", 0)
GPU1 = GpuRef("b1", 1)
GPU2 = GpuRef("b1", 2)
GPU3 = GpuRef("b1", 3)
ZONE_PATH = ZONES


def fabric_map(
    service: RedfishFabricService,
    cert: Path | None,
    *,
    hosts: dict[str, RedfishHost] | None = None,
    **options: Any,
) -> RedfishFabricMap:
    """The map of :func:`install`'s fabric at ``service``; ``options`` set service fields."""
    return RedfishFabricMap(
        service=RedfishService(
            url=service.url,
            fabric=FABRIC,
            username=USERNAME,
            password=PASSWORD,
            ca_bundle=cert,
            timeout_s=0.5,
            attempts=3,
            **options,
        ),
        hosts=hosts
        or {
            "h1": RedfishHost(endpoint="HostPort-h1", zones=("h1-s0", "h1-s1")),
            "h2": RedfishHost(endpoint="HostPort-h2", zones=("h2-s0",)),
        },
        boxes={"b1": tuple(f"GPU-b1-{slot}" for slot in range(4))},
    )


@pytest.fixture(scope="module")
def tls(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    return self_signed_cert(tmp_path_factory.mktemp("tls"))


@pytest.fixture
def serve(tls: tuple[Path, Path]) -> Iterator[Any]:
    """Start a service with the options given (installed, over HTTPS); stopped at the end."""
    stack: list[Any] = []

    def start(service: RedfishFabricService | None = None) -> RedfishFabricService:
        fabric = service or RedfishFabricService()
        install(fabric)
        context = running_service(fabric, tls=tls)
        stack.append(context)
        return context.__enter__()

    yield start
    for context in reversed(stack):
        context.__exit__(None, None, None)


@pytest.fixture
def service(serve: Any) -> RedfishFabricService:
    started: RedfishFabricService = serve()
    return started


@pytest.fixture
def fmap(service: RedfishFabricService, tls: tuple[Path, Path]) -> RedfishFabricMap:
    return fabric_map(service, tls[0])


def status_of(error: DriverError) -> int:
    """The HTTP status of the Redfish answer behind an agent-side error."""
    cause = error.__cause__
    assert isinstance(cause, RedfishStatusError), f"{error!r} has no Redfish status behind it"
    return cause.status


def mapper_for(
    fmap: RedfishFabricMap, host: str = "h1", state_dir: Path | None = None
) -> RedfishProxyMapper:
    return RedfishProxyMapper(
        fmap, host, RedfishSession(fmap.service), retry_wait_s=0, state_dir=state_dir
    )


@pytest.fixture
def mapper(fmap: RedfishFabricMap) -> Iterator[RedfishProxyMapper]:
    built = mapper_for(fmap)
    yield built
    built.close()


# -- good path -------------------------------------------------------------------------------


def test_map_adds_the_gpu_through_the_zone_action_with_both_etags(
    service: RedfishFabricService, mapper: RedfishProxyMapper
) -> None:
    mapper.map(GPU1, 1, generation=3)

    assert service.zone("h1-s1") == ["HostPort-h1", "GPU-b1-1"]
    assert service.zone("h1-s0") == ["HostPort-h1"]
    assert mapper.mappings() == {1: GPU1}
    assert service.writes() == [Write("h1-s1", "add", "GPU-b1-1", '"h1-s1-1"', '"GPU-b1-1-1"')]
    assert service.patches() == []  # Links.Endpoints is read-only: never PATCHed


def test_map_is_idempotent_and_unmap_removes_only_that_gpu(
    service: RedfishFabricService, mapper: RedfishProxyMapper
) -> None:
    mapper.map(GPU0, 0, generation=1)
    mapper.map(GPU1, 1, generation=1)
    mapper.map(GPU0, 0, generation=1)  # already so: no write
    assert len(service.writes()) == 2

    mapper.unmap(GPU0)
    mapper.unmap(GPU0)  # no-op

    assert mapper.mappings() == {1: GPU1}
    assert service.zone("h1-s0") == ["HostPort-h1"]
    assert [w.kind for w in service.writes()] == ["add", "add", "remove"]


def test_connect_checks_the_map_against_the_service(fmap: RedfishFabricMap) -> None:
    mapper = connect_redfish_mapper(fmap, "h1")
    try:
        assert mapper.mappings() == {}
    finally:
        mapper.close()


def test_discovery_names_every_mismatch(
    service: RedfishFabricService, fmap: RedfishFabricMap
) -> None:
    service.add_endpoint("HostPort-h3", "Target")  # a host port that claims to be a device
    service.add_zone("h1-s2", ["HostPort-h2"])  # h1's zone, but it holds h2's port
    wrong = replace(
        fmap,
        hosts={
            **fmap.hosts,
            "h1": RedfishHost(endpoint="HostPort-h1", zones=("h1-s0", "h1-s9", "h1-s2")),
            "h3": RedfishHost(endpoint="HostPort-h3", zones=("h3-s0",)),
        },
        boxes={"b1": ("GPU-b1-0", "GPU-b1-7")},
    )
    with pytest.raises(DriverError) as raised:
        connect_redfish_mapper(wrong, "h1")
    message = raised.value.message
    assert not raised.value.retryable
    assert "endpoint HostPort-h3 (host h3) has EntityRole Target, not Initiator" in message
    assert "endpoint GPU-b1-7 (GPU b1/1) does not exist" in message
    assert "zone h1-s9 (host slot 1 of h1) does not exist" in message
    assert "zone h1-s2 (host slot 2 of h1) does not hold the host's endpoint HostPort-h1" in message


def test_discovery_names_a_fabric_the_service_lacks(
    service: RedfishFabricService, fmap: RedfishFabricMap
) -> None:
    wrong = replace(fmap, service=replace(fmap.service, fabric="CXL"))
    with pytest.raises(DriverError, match=r"has no fabric CXL .* its fabrics are PCIe") as raised:
        connect_redfish_mapper(wrong, "h1")
    assert not raised.value.retryable


def test_plain_http_works_when_the_service_has_no_tls() -> None:
    fabric = RedfishFabricService()
    install(fabric)
    with running_service(fabric) as running:
        mapper = mapper_for(fabric_map(running, None))
        mapper.map(GPU2, 0, generation=1)
        assert mapper.mappings() == {0: GPU2}
        mapper.close()


def test_basic_authentication_needs_no_session(serve: Any, tls: tuple[Path, Path]) -> None:
    service = serve()
    mapper = mapper_for(fabric_map(service, tls[0], auth=AuthMethod.BASIC))
    mapper.map(GPU0, 0, generation=1)
    assert service.zone("h1-s0") == ["HostPort-h1", "GPU-b1-0"]
    assert service.state.sessions == {}
    mapper.close()


def test_a_service_without_etags_is_changed_without_preconditions(
    serve: Any, tls: tuple[Path, Path]
) -> None:
    service = serve(RedfishFabricService(etags="none"))
    mapper = mapper_for(fabric_map(service, tls[0]))
    mapper.map(GPU0, 0, generation=1)
    assert service.writes() == [Write("h1-s0", "add", "GPU-b1-0", "", "")]
    mapper.close()


def test_an_etag_only_in_the_payload_makes_the_change_conditional(
    serve: Any, tls: tuple[Path, Path]
) -> None:
    # DSP0266 lets a service give the ETag as @odata.etag only; it is a precondition all
    # the same (ZoneETag/EndpointETag with the action, If-Match with a PATCH).
    service = serve(RedfishFabricService(etags="payload"))
    mapper = mapper_for(fabric_map(service, tls[0]))
    mapper.map(GPU0, 0, generation=1)
    assert service.writes() == [Write("h1-s0", "add", "GPU-b1-0", '"h1-s0-1"', '"GPU-b1-0-1"')]
    mapper.close()

    legacy = serve(RedfishFabricService.legacy(etags="payload"))
    patcher = mapper_for(fabric_map(legacy, tls[0]))
    patcher.map(GPU0, 0, generation=1)
    assert legacy.patches() == [(f"{ZONE_PATH}/h1-s0", '"h1-s0-1"')]
    patcher.close()


# -- how membership is changed ---------------------------------------------------------------


def test_a_service_without_zone_actions_is_changed_by_a_conditional_patch(
    serve: Any, tls: tuple[Path, Path]
) -> None:
    service = serve(RedfishFabricService.legacy())
    mapper = mapper_for(fabric_map(service, tls[0]))
    mapper.map(GPU1, 1, generation=1)
    mapper.unmap(GPU1)
    assert service.patches() == [
        (f"{ZONE_PATH}/h1-s1", '"h1-s1-1"'),
        (f"{ZONE_PATH}/h1-s1", '"h1-s1-2"'),
    ]
    mapper.close()


def test_a_refused_patch_of_read_only_links_is_reported_and_remembered(
    serve: Any, tls: tuple[Path, Path]
) -> None:
    # No actions, and Links.Endpoints read-only as DMTF's schema has it: the PATCH is a
    # 400 (DSP0266, PATCH of read-only properties). Not retried, not tried again.
    service = serve(RedfishFabricService(zone_actions=False))
    mapper = mapper_for(fabric_map(service, tls[0]))
    with pytest.raises(DriverError, match=r"Links\.Endpoints, which DMTF's Zone schema makes read"):
        mapper.map(GPU0, 0, generation=1)
    with pytest.raises(DriverError, match=r"refused a PATCH of Links\.Endpoints before") as again:
        mapper.map(GPU1, 1, generation=1)
    assert not again.value.retryable
    assert [r.status for r in service.requests if r.method == "PATCH"] == [400]
    assert service.zone("h1-s0") == ["HostPort-h1"]
    mapper.close()


def test_membership_pinned_to_patch_or_actions_is_obeyed(
    serve: Any, tls: tuple[Path, Path]
) -> None:
    patchable = serve(RedfishFabricService(patchable_zones=True))  # offers both ways
    mapper = mapper_for(fabric_map(patchable, tls[0], membership=Membership.PATCH))
    mapper.map(GPU0, 0, generation=1)
    assert [w.kind for w in patchable.writes()] == ["patch"]
    mapper.close()

    without = serve(RedfishFabricService.legacy())
    strict = mapper_for(fabric_map(without, tls[0], membership=Membership.ACTIONS))
    with pytest.raises(DriverError, match=r"offers no #Zone\.AddEndpoint action") as raised:
        strict.map(GPU0, 0, generation=1)
    assert not raised.value.retryable
    assert without.writes() == []
    strict.close()


def test_an_asynchronous_zone_action_is_followed_to_its_end(
    serve: Any, tls: tuple[Path, Path]
) -> None:
    service = serve(RedfishFabricService(async_actions=True, task_polls=2))
    mapper = mapper_for(fabric_map(service, tls[0]))
    mapper.map(GPU0, 0, generation=1)  # the change is applied when the task ends
    assert service.zone("h1-s0") == ["HostPort-h1", "GPU-b1-0"]
    monitor_polls = [r for r in service.requests if "/TaskMonitors/" in r.path]
    assert [r.status for r in monitor_polls] == [202, 202, 204]
    mapper.close()


# -- exclusivity: dxpool's own check ---------------------------------------------------------


def test_a_gpu_in_another_hosts_zone_is_refused_without_a_write(
    service: RedfishFabricService, mapper: RedfishProxyMapper
) -> None:
    # The service would take it (no 409 in the standard): the refusal is dxpool's.
    service.set_zone("h2-s0", ["HostPort-h2", "GPU-b1-0"])

    with pytest.raises(AttachConflictError) as raised:
        mapper.map(GPU0, 0, generation=1)

    assert "is in zone h2-s0 (host h2)" in raised.value.message
    assert "unmap it there first" in raised.value.message
    assert service.writes() == []
    assert service.zone("h1-s0") == ["HostPort-h1"]


def test_a_map_racing_another_hosts_is_refused_by_the_endpoint_etag(
    service: RedfishFabricService, mapper: RedfishProxyMapper
) -> None:
    # h2's agent's map lands between h1's reads and h1's write. h1's zone did not change,
    # but the endpoint did: the EndpointETag h1 sends is stale (412), h1 reads again and
    # finds the GPU in h2's zone.
    service.before_write(lambda: service.set_zone("h2-s0", ["HostPort-h2", "GPU-b1-0"]))

    with pytest.raises(AttachConflictError, match=r"is in zone h2-s0 \(host h2\)"):
        mapper.map(GPU0, 0, generation=1)

    assert service.zones_of("GPU-b1-0") == ["h2-s0"]
    adds = [r for r in service.requests if r.path.endswith("h1-s0/Actions/Zone.AddEndpoint")]
    assert [r.status for r in adds] == [412]


def test_a_map_racing_another_on_a_service_without_etags_is_undone(
    serve: Any, tls: tuple[Path, Path]
) -> None:
    # Without ETags nothing stops both writes; the read-back after h1's write sees the
    # GPU in two zones, and h1 takes it out of its own again.
    service = serve(RedfishFabricService(etags="none"))
    mine = mapper_for(fabric_map(service, tls[0]), "h1")
    service.before_write(lambda: service.set_zone("h2-s0", ["HostPort-h2", "GPU-b1-0"]))

    with pytest.raises(AttachConflictError, match="the map was undone so no two hosts share it"):
        mine.map(GPU0, 0, generation=1)

    assert service.zones_of("GPU-b1-0") == ["h2-s0"]
    assert [(w.zone, w.kind) for w in service.writes()] == [("h1-s0", "add"), ("h1-s0", "remove")]
    mine.close()


def test_a_service_that_refuses_a_second_zone_is_a_conflict_too(
    serve: Any, tls: tuple[Path, Path]
) -> None:
    service = serve(RedfishFabricService.legacy())
    mapper = mapper_for(fabric_map(service, tls[0]))
    service.before_write(lambda: service.set_zone("h2-s0", ["HostPort-h2", "GPU-b1-0"]))
    with pytest.raises(AttachConflictError, match="already assigned to zone h2-s0"):
        mapper.map(GPU0, 0, generation=1)
    assert service.zone("h1-s0") == ["HostPort-h1"]
    mapper.close()


def test_a_slot_holding_another_gpu_is_a_conflict_without_a_write(
    service: RedfishFabricService, mapper: RedfishProxyMapper
) -> None:
    mapper.map(GPU0, 0, generation=1)
    with pytest.raises(
        AttachConflictError, match=r"already holds boxes/b1/gpus/0 \(endpoint GPU-b1-0\)"
    ):
        mapper.map(GPU1, 0, generation=1)
    assert len(service.writes()) == 1


def test_endpoints_that_are_not_gpus_share_the_zone_and_are_left_alone(
    service: RedfishFabricService, mapper: RedfishProxyMapper
) -> None:
    # DMTF's CXL mockups put the switch's endpoint in every zone.
    service.add_endpoint("Switch", "Target")
    service.set_zone("h1-s0", ["HostPort-h1", "Switch"])

    mapper.map(GPU0, 0, generation=1)
    assert mapper.mappings() == {0: GPU0}
    mapper.unmap(GPU0)

    assert service.zone("h1-s0") == ["HostPort-h1", "Switch"]


def test_unknown_slots_and_gpus_are_not_retryable(mapper: RedfishProxyMapper) -> None:
    with pytest.raises(DriverError, match="host slot 5 of h1 is outside the 2 slots") as slot:
        mapper.map(GPU0, 5, generation=1)
    with pytest.raises(DriverError, match=r"list it under boxes\.b9") as gpu:
        mapper.map(GpuRef("b9", 0), 0, generation=1)
    assert not slot.value.retryable
    assert not gpu.value.retryable


def test_a_zone_without_the_host_port_is_reported(
    service: RedfishFabricService, mapper: RedfishProxyMapper
) -> None:
    service.set_zone("h1-s0", [])
    with pytest.raises(DriverError, match="does not hold the host's endpoint HostPort-h1"):
        mapper.map(GPU0, 0, generation=1)


def test_a_4xx_is_not_retried_and_carries_the_services_message(
    service: RedfishFabricService, mapper: RedfishProxyMapper
) -> None:
    service.fail("POST", "/h1-s0/Actions/Zone.AddEndpoint", 400)
    with pytest.raises(DriverError) as raised:
        mapper.map(GPU0, 0, generation=1)
    assert status_of(raised.value) == 400
    assert not raised.value.retryable
    assert "answered 400 to POST" in raised.value.message
    assert "injected failure" in raised.value.message
    assert len(service.writes()) == 1


# -- zone per host port ----------------------------------------------------------------------


def port_map(service: RedfishFabricService, cert: Path, slots: int = 3) -> RedfishFabricMap:
    service.add_endpoint("Switch", "Target")
    service.add_zone("h1-port", ["HostPort-h1", "Switch"])
    return fabric_map(
        service,
        cert,
        hosts={
            "h1": RedfishHost(endpoint="HostPort-h1", zones=("h1-port",), port_slots=slots),
            "h2": RedfishHost(endpoint="HostPort-h2", zones=("h2-s0",)),
        },
    )


def test_a_zone_per_host_port_holds_several_gpus_at_their_slots(
    service: RedfishFabricService, tls: tuple[Path, Path], tmp_path: Path
) -> None:
    fmap = port_map(service, tls[0])
    mapper = mapper_for(fmap, state_dir=tmp_path)
    mapper.map(GPU2, 2, generation=1)
    mapper.map(GPU0, 0, generation=1)
    assert service.zone("h1-port") == ["HostPort-h1", "Switch", "GPU-b1-2", "GPU-b1-0"]
    assert mapper.mappings() == {0: GPU0, 2: GPU2}
    mapper.close()

    restarted = mapper_for(fmap, state_dir=tmp_path)  # the slots survive a restart
    assert restarted.mappings() == {0: GPU0, 2: GPU2}
    with pytest.raises(AttachConflictError, match=r"host slot 0 of h1 .* already holds"):
        restarted.map(GPU1, 0, generation=1)
    with pytest.raises(AttachConflictError, match="mapped at host slot 2 of h1, not 1"):
        restarted.map(GPU2, 1, generation=1)
    restarted.unmap(GPU2)
    assert restarted.mappings() == {0: GPU0}
    assert service.zone("h1-port") == ["HostPort-h1", "Switch", "GPU-b1-0"]
    restarted.close()


def test_a_gpu_put_in_the_port_zone_by_hand_gets_a_free_slot(
    service: RedfishFabricService, tls: tuple[Path, Path]
) -> None:
    fmap = port_map(service, tls[0], slots=2)
    mapper = mapper_for(fmap)
    service.set_zone("h1-port", ["HostPort-h1", "Switch", "GPU-b1-3"])  # mapped by hand
    assert mapper.mappings() == {0: GPU3}
    mapper.map(GPU1, 1, generation=1)
    with pytest.raises(AttachConflictError, match=r"host slot 0 of h1 .* holds boxes/b1/gpus/3"):
        mapper.map(GPU0, 0, generation=1)
    with pytest.raises(DriverError, match="host slot 2 of h1 is outside the 2 slots"):
        mapper.map(GPU0, 2, generation=1)
    assert mapper.mappings() == {0: GPU3, 1: GPU1}
    mapper.close()


# -- retried when safe -----------------------------------------------------------------------


def test_a_zone_changed_between_read_and_write_is_read_again(
    service: RedfishFabricService, mapper: RedfishProxyMapper
) -> None:
    # Another client of the fabric manager changes h1-s0 (its ETag moves) after our read
    # and before our write: our ZoneETag is stale (412), we read again and redo.
    service.before_write(lambda: service.set_zone("h1-s0", ["HostPort-h1"]))

    mapper.map(GPU0, 0, generation=1)

    assert service.zone("h1-s0") == ["HostPort-h1", "GPU-b1-0"]
    assert [w.etag for w in service.writes()] == ['"h1-s0-1"', '"h1-s0-2"']


def test_a_zone_that_gained_a_gpu_underneath_becomes_a_conflict_not_an_overwrite(
    service: RedfishFabricService, mapper: RedfishProxyMapper
) -> None:
    service.before_write(lambda: service.set_zone("h1-s0", ["HostPort-h1", "GPU-b1-3"]))

    with pytest.raises(AttachConflictError, match="already holds boxes/b1/gpus/3"):
        mapper.map(GPU0, 0, generation=1)

    assert service.zone("h1-s0") == ["HostPort-h1", "GPU-b1-3"]  # the other write survives


def test_a_zone_that_keeps_changing_gives_up_retryably(
    service: RedfishFabricService, mapper: RedfishProxyMapper
) -> None:
    for _ in range(3):
        service.before_write(lambda: service.set_zone("h1-s0", ["HostPort-h1"]))
    with pytest.raises(DriverError) as raised:
        mapper.map(GPU0, 0, generation=1)
    assert status_of(raised.value) == 412
    assert raised.value.retryable
    assert len(service.writes()) == 3


def test_server_errors_are_retried_then_reported(
    service: RedfishFabricService, mapper: RedfishProxyMapper
) -> None:
    service.fail("POST", "/h1-s0/Actions/Zone.AddEndpoint", 503, count=2)
    mapper.map(GPU0, 0, generation=1)
    assert service.zone("h1-s0") == ["HostPort-h1", "GPU-b1-0"]

    service.fail("GET", "/Zones/h1-s1", 500, count=3)
    with pytest.raises(DriverError, match="answered 500 to GET") as raised:
        mapper.mappings()
    assert raised.value.retryable


def test_a_slow_answer_times_out_and_the_operation_is_redone_from_a_read(
    service: RedfishFabricService, mapper: RedfishProxyMapper
) -> None:
    # The action is carried out but answered too late: the retry reads the zone, finds
    # the GPU there and writes nothing more.
    service.delay("POST", "/h1-s0/Actions/Zone.AddEndpoint", 1.0)
    mapper.map(GPU0, 0, generation=1)
    assert service.zone("h1-s0") == ["HostPort-h1", "GPU-b1-0"]
    assert len(service.writes()) == 1


def test_a_service_that_never_answers_in_time_is_unreachable_and_retryable(
    service: RedfishFabricService, mapper: RedfishProxyMapper
) -> None:
    service.delay("GET", "/Zones/h1-s0", 1.0, count=3)
    with pytest.raises(DriverError, match=r"did not answer GET .*h1-s0 in time") as raised:
        mapper.mappings()
    assert raised.value.retryable
    assert isinstance(raised.value.__cause__, RedfishUnreachableError)


def test_an_expired_session_logs_in_again(
    service: RedfishFabricService, mapper: RedfishProxyMapper
) -> None:
    mapper.map(GPU0, 0, generation=1)
    service.expire_sessions()

    assert mapper.mappings() == {0: GPU0}
    logins = [r for r in service.requests if r.method == "POST" and r.path.endswith("Sessions")]
    assert len(logins) == 2  # the first login and one re-login


def test_wrong_credentials_are_not_retryable(fmap: RedfishFabricMap) -> None:
    wrong = replace(fmap, service=replace(fmap.service, password="nope"))
    with pytest.raises(
        RedfishLoginError, match="refused the credentials of Redfish user 'dxpool'"
    ) as e:
        RedfishSession(wrong.service)
    assert not e.value.retryable
    with pytest.raises(DriverError, match="refused the credentials") as agent_side:
        connect_redfish_mapper(wrong, "h1")
    assert not agent_side.value.retryable


def test_an_untrusted_certificate_is_refused_with_a_fix(fmap: RedfishFabricMap) -> None:
    untrusted = replace(fmap.service, ca_bundle=None)  # the public CAs do not sign it
    with pytest.raises(RedfishUnreachableError, match=r"set service\.ca_bundle") as raised:
        RedfishSession(untrusted)
    assert not raised.value.retryable


@pytest.mark.filterwarnings("ignore::urllib3.exceptions.InsecureRequestWarning")
def test_verify_false_accepts_any_certificate(fmap: RedfishFabricMap) -> None:
    session = RedfishSession(replace(fmap.service, ca_bundle=None, verify=False))
    try:
        assert session.get(f"{ZONE_PATH}/h1-s0").etag == '"h1-s0-1"'
    finally:
        session.close()


def test_close_deletes_the_session(service: RedfishFabricService, fmap: RedfishFabricMap) -> None:
    session = RedfishSession(fmap.service)
    assert len(service.state.sessions) == 1
    session.close()
    assert service.state.sessions == {}


# -- finding the zones that hold an endpoint -------------------------------------------------


def zone_reads(service: RedfishFabricService) -> int:
    return sum(1 for r in service.requests if r.method == "GET" and r.path.startswith(ZONES))


def test_links_zones_is_trusted_once_a_change_showed_up_there(
    service: RedfishFabricService, mapper: RedfishProxyMapper
) -> None:
    assert not mapper.zones.trusts_endpoint_zones
    mapper.map(GPU0, 0, generation=1)  # scans, and sees its own add in Links.Zones
    assert mapper.zones.trusts_endpoint_zones
    for zone in range(20):
        service.add_zone(f"spare-{zone}", [])
    before = zone_reads(service)
    mapper.map(GPU1, 1, generation=1)
    assert zone_reads(service) - before <= 3  # the slot's zone, read back; not 23 zones


def test_stale_links_zones_are_not_trusted_and_every_zone_is_read(
    serve: Any, tls: tuple[Path, Path]
) -> None:
    # As DMTF's Mockup Server: Links.Zones as first written, never updated.
    service = serve(RedfishFabricService(reverse_links="stale"))
    mapper = mapper_for(fabric_map(service, tls[0]))
    mapper.map(GPU0, 0, generation=1)
    assert not mapper.zones.trusts_endpoint_zones
    other = mapper_for(fabric_map(service, tls[0], zone_lookup=ZoneLookup.AUTO), "h2")
    with pytest.raises(AttachConflictError, match=r"is in zone h1-s0 \(host h1\)"):
        other.map(GPU0, 0, generation=1)  # Links.Zones says nothing; the zones do
    mapper.close()
    other.close()


# -- fencing ---------------------------------------------------------------------------------


def test_fence_revokes_only_that_hosts_mappings(
    service: RedfishFabricService, fmap: RedfishFabricMap, mapper: RedfishProxyMapper
) -> None:
    mapper.map(GPU0, 0, generation=1)
    mapper.map(GPU1, 1, generation=1)
    other = mapper_for(fmap, "h2")
    other.map(GPU2, 0, generation=1)

    assert other.fence("h1") == [GPU0, GPU1]  # the fencer is not the fenced host

    assert service.zone("h1-s0") == ["HostPort-h1"]
    assert service.zone("h1-s1") == ["HostPort-h1"]
    assert service.zone("h2-s0") == ["HostPort-h2", "GPU-b1-2"]
    assert mapper.mappings() == {}
    assert other.fence("h1") == []  # idempotent
    other.close()


def test_fence_finds_zones_outside_the_map_and_spares_shared_ones_and_non_gpus(
    service: RedfishFabricService, mapper: RedfishProxyMapper
) -> None:
    service.add_endpoint("Switch", "Target")
    service.add_zone("by-hand", ["HostPort-h1", "GPU-b1-3", "Switch"])  # made by hand
    service.add_zone("shared", ["HostPort-h1", "HostPort-h2", "GPU-b1-2"])

    assert mapper.fence("h1") == [GPU2, GPU3]

    assert service.zone("by-hand") == ["HostPort-h1", "Switch"]
    assert service.zone("shared") == ["HostPort-h2", "GPU-b1-2"]  # h2 keeps its access


def test_fence_rereads_a_zone_that_changed_underneath(
    service: RedfishFabricService, fmap: RedfishFabricMap, mapper: RedfishProxyMapper
) -> None:
    mapper.map(GPU0, 0, generation=1)
    # The fenced host's agent, still running, maps another GPU between the fencer's read
    # and write: the fence's ZoneETag is stale and the fresh read revokes both.
    service.before_write(lambda: service.set_zone("h1-s0", ["HostPort-h1", "GPU-b1-0", "GPU-b1-3"]))
    fencer = mapper_for(fmap, "h2")
    service.set_zone("h1-s1", ["HostPort-h1", "GPU-b1-1"])

    assert fencer.fence("h1") == [GPU0, GPU1, GPU3]
    assert service.zone("h1-s0") == ["HostPort-h1"]
    assert service.zone("h1-s1") == ["HostPort-h1"]
    fencer.close()


def test_fence_of_a_host_outside_the_map_is_refused(mapper: RedfishProxyMapper) -> None:
    with pytest.raises(DriverError, match="cannot fence host 'h9'") as raised:
        mapper.fence("h9")
    assert not raised.value.retryable


def test_concurrent_maps_from_several_threads_each_land(
    service: RedfishFabricService, mapper: RedfishProxyMapper
) -> None:
    errors: list[BaseException] = []

    def attach(gpu: GpuRef, slot: int) -> None:
        try:
            mapper.map(gpu, slot, generation=1)
        except BaseException as error:
            errors.append(error)

    threads = [
        threading.Thread(target=attach, args=(GPU0, 0)),
        threading.Thread(target=attach, args=(GPU1, 1)),
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == []
    assert mapper.mappings() == {0: GPU0, 1: GPU1}
