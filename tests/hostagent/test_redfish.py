"""RedfishProxyMapper against a local Redfish fabric service over HTTPS."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest

from dxpool.hostagent.drivers.redfish import RedfishProxyMapper, connect_redfish_mapper
from dxpool.hostagent.errors import AttachConflictError, DriverError
from dxpool.names import GpuRef
from dxpool.redfish.fabric_map import RedfishFabricMap, RedfishHost, RedfishService
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
    RedfishFabricService,
    install,
    running_service,
    self_signed_cert,
)

GPU0 = GpuRef("b1", 0)
GPU1 = GpuRef("b1", 1)
GPU2 = GpuRef("b1", 2)
GPU3 = GpuRef("b1", 3)
ZONE_PATH = f"/redfish/v1/Fabrics/{FABRIC}/Zones"


def fabric_map(service: RedfishFabricService, cert: Path | None) -> RedfishFabricMap:
    return RedfishFabricMap(
        service=RedfishService(
            url=service.url,
            fabric=FABRIC,
            username=USERNAME,
            password=PASSWORD,
            ca_bundle=cert,
            timeout_s=0.5,
            attempts=3,
        ),
        hosts={
            "h1": RedfishHost(endpoint="HostPort-h1", zones=("h1-s0", "h1-s1")),
            "h2": RedfishHost(endpoint="HostPort-h2", zones=("h2-s0",)),
        },
        boxes={"b1": tuple(f"GPU-b1-{slot}" for slot in range(4))},
    )


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


def status_of(error: DriverError) -> int:
    """The HTTP status of the Redfish answer behind an agent-side error."""
    cause = error.__cause__
    assert isinstance(cause, RedfishStatusError), f"{error!r} has no Redfish status behind it"
    return cause.status


def mapper_for(fmap: RedfishFabricMap, host: str = "h1") -> RedfishProxyMapper:
    return RedfishProxyMapper(fmap, host, RedfishSession(fmap.service), retry_wait_s=0)


@pytest.fixture
def mapper(fmap: RedfishFabricMap) -> Iterator[RedfishProxyMapper]:
    built = mapper_for(fmap)
    yield built
    built.close()


# -- good path -------------------------------------------------------------------------------


def test_map_adds_the_gpu_endpoint_to_the_slot_zone_with_if_match(
    service: RedfishFabricService, mapper: RedfishProxyMapper
) -> None:
    mapper.map(GPU1, 1, generation=3)

    assert service.zone("h1-s1") == ["HostPort-h1", "GPU-b1-1"]
    assert service.zone("h1-s0") == ["HostPort-h1"]
    assert mapper.mappings() == {1: GPU1}
    assert service.patches() == [(f"{ZONE_PATH}/h1-s1", '"h1-s1-1"')]


def test_map_is_idempotent_and_unmap_removes_only_that_gpu(
    service: RedfishFabricService, mapper: RedfishProxyMapper
) -> None:
    mapper.map(GPU0, 0, generation=1)
    mapper.map(GPU1, 1, generation=1)
    mapper.map(GPU0, 0, generation=1)  # already so: no write
    assert len(service.patches()) == 2

    mapper.unmap(GPU0)
    mapper.unmap(GPU0)  # no-op

    assert mapper.mappings() == {1: GPU1}
    assert service.zone("h1-s0") == ["HostPort-h1"]
    assert len(service.patches()) == 3


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
    wrong = replace(
        fmap,
        hosts={
            **fmap.hosts,
            "h1": RedfishHost(endpoint="HostPort-h1", zones=("h1-s0", "h1-s9")),
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


def test_plain_http_works_when_the_service_has_no_tls() -> None:
    fabric = RedfishFabricService()
    install(fabric)
    with running_service(fabric) as running:
        mapper = mapper_for(fabric_map(running, None))
        mapper.map(GPU2, 0, generation=1)
        assert mapper.mappings() == {0: GPU2}
        mapper.close()


def test_a_service_without_etags_is_patched_unconditionally() -> None:
    fabric = RedfishFabricService(etags=False)
    install(fabric)
    with running_service(fabric) as running:
        mapper = mapper_for(fabric_map(running, None))
        mapper.map(GPU0, 0, generation=1)
        assert fabric.patches() == [(f"{ZONE_PATH}/h1-s0", "")]
        mapper.close()


# -- conflicts and bad requests ----------------------------------------------------------


def test_a_gpu_in_another_hosts_zone_is_a_conflict_with_the_services_reason(
    service: RedfishFabricService, mapper: RedfishProxyMapper
) -> None:
    service.set_zone("h2-s0", ["HostPort-h2", "GPU-b1-0"])

    with pytest.raises(AttachConflictError) as raised:
        mapper.map(GPU0, 0, generation=1)

    assert "already assigned to zone h2-s0" in raised.value.message
    assert "unmap it there first" in raised.value.message
    assert len(service.patches()) == 1  # a conflict is not retried
    assert service.zone("h1-s0") == ["HostPort-h1"]


def test_two_hosts_racing_for_one_gpu_get_it_once(
    service: RedfishFabricService, fmap: RedfishFabricMap, mapper: RedfishProxyMapper
) -> None:
    # h2's agent maps GPU 0 between h1's read of its zone and h1's write: h1's zone did
    # not change (its If-Match holds), but the service refuses a second zone for the GPU.
    other = mapper_for(fmap, "h2")
    service.before_patch(lambda: other.map(GPU0, 0, generation=2))

    with pytest.raises(AttachConflictError, match="already assigned to zone h2-s0"):
        mapper.map(GPU0, 0, generation=1)

    assert service.zone("h2-s0") == ["HostPort-h2", "GPU-b1-0"]
    assert service.zone("h1-s0") == ["HostPort-h1"]
    assert other.mappings() == {0: GPU0}
    other.close()


def test_a_slot_holding_another_gpu_is_a_conflict_without_a_write(
    service: RedfishFabricService, mapper: RedfishProxyMapper
) -> None:
    mapper.map(GPU0, 0, generation=1)
    with pytest.raises(
        AttachConflictError, match=r"already holds boxes/b1/gpus/0 \(endpoint GPU-b1-0\)"
    ):
        mapper.map(GPU1, 0, generation=1)
    assert len(service.patches()) == 1


def test_unknown_slots_and_gpus_are_not_retryable(mapper: RedfishProxyMapper) -> None:
    with pytest.raises(DriverError, match="host slot 5 of h1 has no zone") as slot:
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
    service.fail("PATCH", "/Zones/h1-s0", 400)
    with pytest.raises(DriverError) as raised:
        mapper.map(GPU0, 0, generation=1)
    assert status_of(raised.value) == 400
    assert not raised.value.retryable
    assert "answered 400 to PATCH" in raised.value.message
    assert "injected failure" in raised.value.message
    assert len(service.patches()) == 1


# -- retried when safe -------------------------------------------------------------------


def test_a_zone_changed_between_read_and_write_is_read_again(
    service: RedfishFabricService, mapper: RedfishProxyMapper
) -> None:
    # Another client of the fabric manager maps GPU 3 into h2's zone after our read of
    # h1-s0 and before our write: our If-Match fails (412), we read again and redo.
    service.before_patch(lambda: service.set_zone("h1-s0", ["HostPort-h1"]))

    mapper.map(GPU0, 0, generation=1)

    assert service.zone("h1-s0") == ["HostPort-h1", "GPU-b1-0"]
    assert service.patches() == [
        (f"{ZONE_PATH}/h1-s0", '"h1-s0-1"'),  # refused: the zone is at 2 by then
        (f"{ZONE_PATH}/h1-s0", '"h1-s0-2"'),
    ]


def test_a_zone_that_gained_a_gpu_underneath_becomes_a_conflict_not_an_overwrite(
    service: RedfishFabricService, mapper: RedfishProxyMapper
) -> None:
    service.before_patch(lambda: service.set_zone("h1-s0", ["HostPort-h1", "GPU-b1-3"]))

    with pytest.raises(AttachConflictError, match="already holds boxes/b1/gpus/3"):
        mapper.map(GPU0, 0, generation=1)

    assert service.zone("h1-s0") == ["HostPort-h1", "GPU-b1-3"]  # the other write survives


def test_a_zone_that_keeps_changing_gives_up_retryably(
    service: RedfishFabricService, mapper: RedfishProxyMapper
) -> None:
    for _ in range(3):
        service.before_patch(lambda: service.set_zone("h1-s0", ["HostPort-h1"]))
    with pytest.raises(DriverError) as raised:
        mapper.map(GPU0, 0, generation=1)
    assert status_of(raised.value) == 412
    assert raised.value.retryable
    assert len(service.patches()) == 3


def test_server_errors_are_retried_then_reported(
    service: RedfishFabricService, mapper: RedfishProxyMapper
) -> None:
    service.fail("PATCH", "/Zones/h1-s0", 503, count=2)
    mapper.map(GPU0, 0, generation=1)
    assert service.zone("h1-s0") == ["HostPort-h1", "GPU-b1-0"]

    service.fail("GET", "/Zones/h1-s1", 500, count=3)
    with pytest.raises(DriverError, match="answered 500 to GET") as raised:
        mapper.mappings()
    assert raised.value.retryable


def test_a_slow_answer_times_out_and_the_operation_is_redone_from_a_read(
    service: RedfishFabricService, mapper: RedfishProxyMapper
) -> None:
    # The PATCH is applied but answered too late: the retry reads the zone, finds the
    # GPU there and writes nothing more.
    service.delay("PATCH", "/Zones/h1-s0", 1.0)
    mapper.map(GPU0, 0, generation=1)
    assert service.zone("h1-s0") == ["HostPort-h1", "GPU-b1-0"]
    assert len(service.patches()) == 1


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
    posts = [r for r in service.requests if r[0] == "POST"]
    assert len(posts) == 2  # the first login and one re-login


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


# -- fencing -----------------------------------------------------------------------------


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


def test_fence_finds_zones_outside_the_map_and_spares_shared_ones(
    service: RedfishFabricService, mapper: RedfishProxyMapper
) -> None:
    service.add_zone("by-hand", ["HostPort-h1", "GPU-b1-3"])  # made at the service by hand
    service.add_zone("shared", ["HostPort-h1", "HostPort-h2", "GPU-b1-2"])

    assert mapper.fence("h1") == [GPU2, GPU3]

    assert service.zone("by-hand") == ["HostPort-h1"]
    assert service.zone("shared") == ["HostPort-h2", "GPU-b1-2"]  # h2 keeps its access


def test_fence_skips_a_zone_deleted_between_the_listing_and_its_read(
    service: RedfishFabricService, mapper: RedfishProxyMapper, monkeypatch: pytest.MonkeyPatch
) -> None:
    service.add_zone("by-hand", ["HostPort-h1", "GPU-b1-3"])
    mapper.map(GPU0, 0, generation=1)
    listed = mapper._zones.zone_ids

    def listed_then_deleted() -> list[str]:
        zones = listed()
        service.remove_zone("by-hand")  # an operator deletes it before the fence reads it
        return zones

    monkeypatch.setattr(mapper._zones, "zone_ids", listed_then_deleted)

    assert mapper.fence("h1") == [GPU0]  # the gone zone holds nothing; the rest is fenced
    assert service.zone("h1-s0") == ["HostPort-h1"]


def test_fence_rereads_a_zone_that_changed_underneath(
    service: RedfishFabricService, fmap: RedfishFabricMap, mapper: RedfishProxyMapper
) -> None:
    mapper.map(GPU0, 0, generation=1)
    # The fenced host's agent, still running, maps another GPU between the fencer's read
    # and write: the fence's If-Match fails and the fresh read revokes both.
    service.before_patch(lambda: service.set_zone("h1-s0", ["HostPort-h1", "GPU-b1-0", "GPU-b1-3"]))
    fencer = mapper_for(fmap, "h2")
    service.set_zone("h1-s1", ["HostPort-h1", "GPU-b1-1"])

    assert fencer.fence("h1") == [GPU0, GPU1, GPU3]
    assert [etag for _, etag in service.patches()[-3:-1]] == ['"h1-s0-2"', '"h1-s0-3"']
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
