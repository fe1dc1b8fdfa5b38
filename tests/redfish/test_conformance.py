"""dxpool's Redfish code against DMTF's own Redfish Mockup Server serving DMTF's mockups.

Each test says which service it runs against: the Mockup Server as it is, or behind the
recording proxy (:mod:`tests.redfish.proxy`) with the rules it enforces and where in
DSP0266 or DMTF's schema each rule comes from. The mockups' own ids and shapes are used
as they are: ``public-cxl`` (zones holding the switch's endpoint ``1``; zone ``3`` holding
host port ``I3`` with devices ``T3``, ``T4``, ``T5``), ``public-cxl-multiswitch`` (no
session service; ``Endpoint.Links.Zones`` that disagree with the zones; endpoint ``I5``
left out of the Endpoints collection), ``public-expansion-box`` (no fabric at all).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import pytest
import requests

from dxpool.broker.control.box_fabric import BoxFabricError
from dxpool.broker.control.box_fabric_redfish import RedfishBoxFabric
from dxpool.hostagent.drivers.redfish import RedfishProxyMapper, connect_redfish_mapper
from dxpool.hostagent.errors import AttachConflictError, DriverError
from dxpool.names import GpuRef
from dxpool.redfish.fabric_map import (
    AuthMethod,
    RedfishFabricMap,
    RedfishHost,
    RedfishScrub,
    RedfishService,
    ResetAction,
)
from dxpool.redfish.session import RedfishLoginError, RedfishSession
from tests.redfish.mockup import MockupServer
from tests.redfish.proxy import MONITORS, RecordingProxy, Rules

Mockup = Callable[[str], MockupServer]
Proxied = Callable[[MockupServer, Rules], RecordingProxy]

FABRIC = "/redfish/v1/Fabrics/CXL"
ZONES = f"{FABRIC}/Zones"
ENDPOINTS = f"{FABRIC}/Endpoints"
# The standard's behaviours the Mockup Server lacks, all at once: a conforming service.
CONFORMING = Rules(etags="header", read_only_links=True, zone_actions=True)
# public-cxl's CXL logical device of T1 offers this action; the map names it as the
# vendor's way to clear the device (its memory) between tenants.
SECURE_ERASE = ResetAction(
    "#CXLLogicalDevice.PassphraseSecureErase",
    {"PassphraseType": "Master", "Passphrase": "dxpool-test"},
)

T1, T2, T3, T4, T5 = (GpuRef("b1", slot) for slot in range(5))


def service(url: str, **options: Any) -> RedfishService:
    settings: dict[str, Any] = {"timeout_s": 10.0, "attempts": 3, **options}
    return RedfishService(
        url=url, fabric="CXL", username="Administrator", password="unused", **settings
    )


def cxl_map(url: str, *, scrub: RedfishScrub | None = None, **options: Any) -> RedfishFabricMap:
    """public-cxl: one zone per host port; T1-T4 are GPUs, T5 (memory) and the switch's
    endpoint 1 are not."""
    return RedfishFabricMap(
        service=service(url, **options),
        hosts={
            "h1": RedfishHost(endpoint="I1", zones=("1",), port_slots=2),
            "h2": RedfishHost(endpoint="I2", zones=("2",), port_slots=2),
            "h3": RedfishHost(endpoint="I3", zones=("3",), port_slots=3),
        },
        boxes={"b1": ("T1", "T2", "T3", "T4")},
        scrub=scrub or RedfishScrub(),
    )


def multiswitch_map(url: str, **options: Any) -> RedfishFabricMap:
    """public-cxl-multiswitch: no session service (HTTP Basic); one zone per host port."""
    return RedfishFabricMap(
        service=service(url, auth=AuthMethod.BASIC, **options),
        hosts={
            "h1": RedfishHost(endpoint="I1", zones=("1",), port_slots=2),
            "h2": RedfishHost(endpoint="I2", zones=("2",), port_slots=2),
            "h5": RedfishHost(endpoint="I5", zones=("3",), port_slots=2),
        },
        boxes={"b1": ("T1", "T2", "T3", "T4", "T5")},
    )


def mapper(fmap: RedfishFabricMap, host: str) -> RedfishProxyMapper:
    return RedfishProxyMapper(fmap, host, RedfishSession(fmap.service), retry_wait_s=0)


def box(fmap: RedfishFabricMap) -> RedfishBoxFabric:
    return RedfishBoxFabric(fmap, retry_wait_s=0)


def members(server: MockupServer, zone: str) -> list[str]:
    """A zone's members as the Mockup Server holds them."""
    links: Any = server.get(f"{ZONES}/{zone}")["Links"]
    return [link["@odata.id"].rpartition("/")[2] for link in links["Endpoints"]]


def set_members(server: MockupServer, zone: str, endpoints: list[str]) -> None:
    """Change a zone in the Mockup Server's memory, as another client of it would."""
    links = [{"@odata.id": f"{ENDPOINTS}/{e}"} for e in endpoints]
    server.patch(f"{ZONES}/{zone}", {"Links": {"Endpoints": links}})


def join(server: MockupServer, zone: str, endpoint: str) -> None:
    """What a conforming AddEndpoint does, done as another client: the zone and the
    endpoint's Links.Zones change together."""
    set_members(server, zone, [*members(server, zone), endpoint])
    zones: Any = server.get(f"{ENDPOINTS}/{endpoint}").get("Links", {}).get("Zones", [])
    zones = [*zones, {"@odata.id": f"{ZONES}/{zone}"}]
    server.patch(f"{ENDPOINTS}/{endpoint}", {"Links": {"Zones": zones}})


def writes(proxy: RecordingProxy) -> list[tuple[str, str, int]]:
    """(method, path below the fabric, status) of every write through the proxy."""
    return [(e.method, e.path.removeprefix(f"{FABRIC}/"), e.status) for e in proxy.writes()]


# -- why dxpool checks for itself ------------------------------------------------------------


def test_the_mockup_server_itself_lets_one_gpu_into_two_hosts_zones(mockup: Mockup) -> None:
    """Service: the Mockup Server as it is (public-cxl-multiswitch). It shows what a
    service may do and dxpool must not rely on it refusing: a PATCH of the read-only
    Links.Endpoints that adds T2 - already in I2's zone 2 - to I1's zone 1, with a stale
    If-Match, is answered 204, and T2 is then in both hosts' zones."""
    server = mockup("public-cxl-multiswitch")
    links = [{"@odata.id": f"{ENDPOINTS}/{e}"} for e in ("I1", "T1", "T2")]
    answer = requests.patch(
        f"{server.url}{ZONES}/1",
        json={"Links": {"Endpoints": links}},
        headers={"If-Match": '"stale"'},
        timeout=10,
    )
    assert answer.status_code == 204
    assert "ETag" not in requests.get(f"{server.url}{ZONES}/1", timeout=10).headers
    assert members(server, "1") == ["I1", "T1", "T2"]
    assert members(server, "2") == ["I2", "T2"]


# -- 1. exclusivity is dxpool's own check ----------------------------------------------------


def test_a_gpu_another_hosts_zone_holds_is_refused_before_any_write(
    mockup: Mockup, proxied: Proxied
) -> None:
    """Behaviour 1. Service: the Mockup Server (public-cxl-multiswitch), which would
    take the write, behind the recording proxy with no rules (it only records)."""
    server = mockup("public-cxl-multiswitch")
    proxy = proxied(server, Rules())
    h1 = mapper(multiswitch_map(proxy.url), "h1")

    with pytest.raises(AttachConflictError, match=r"T2\) is in zone 2 \(host h2\)"):
        h1.map(T2, 1, generation=1)

    assert writes(proxy) == []
    assert members(server, "1") == ["I1", "T1"]
    h1.close()


def test_a_map_that_loses_a_race_to_a_stale_agent_is_undone(
    mockup: Mockup, proxied: Proxied
) -> None:
    """Behaviour 1. Service: the Mockup Server (public-cxl-multiswitch: no ETags, no
    actions, PATCH taken) behind the recording proxy, which runs a stale agent's write
    between h2's check and h2's write. With nothing to make the write conditional, h2's
    read-back finds T3 in two zones and takes it out of its own again."""
    server = mockup("public-cxl-multiswitch")
    proxy = proxied(server, Rules())
    h2 = mapper(multiswitch_map(proxy.url), "h2")
    proxy.before_write(lambda: set_members(server, "1", ["I1", "T1", "T3"]))  # h1's stale map

    with pytest.raises(AttachConflictError, match="the map was undone so no two hosts share it"):
        h2.map(T3, 1, generation=1)

    assert members(server, "1") == ["I1", "T1", "T3"]
    assert members(server, "2") == ["I2", "T2"]
    assert writes(proxy) == [("PATCH", "Zones/2", 204), ("PATCH", "Zones/2", 204)]
    # The mockup's Links.Zones (T3 claims zone 3, which does not hold it) was not trusted.
    assert not h2.zones.trusts_endpoint_zones
    h2.close()


def test_the_endpoint_etag_refuses_a_second_zone_atomically(
    mockup: Mockup, proxied: Proxied
) -> None:
    """Behaviour 1. Service: the Mockup Server (public-cxl) behind the proxy enforcing
    ETags (DSP0266 "ETags"), read-only Links (DSP0266 "PATCH (update)") and the zone
    actions with EndpointETag (Zone v1.5+). Another host's AddEndpoint of T1 lands between
    h2's reads and h2's action: h2's EndpointETag is stale (412), and the fresh read finds
    T1 in zone 1."""
    server = mockup("public-cxl")
    proxy = proxied(server, CONFORMING)
    h2 = mapper(cxl_map(proxy.url), "h2")
    set_members(server, "1", ["I1", "1"])  # T1 free ...
    server.patch(f"{ENDPOINTS}/T1", {"Links": {"Zones": []}})
    proxy.before_write(lambda: join(server, "1", "T1"))  # ... until h1 takes it

    with pytest.raises(AttachConflictError, match=r"T1\) is in zone 1 \(host h1\)"):
        h2.map(T1, 1, generation=1)

    assert writes(proxy) == [("POST", "Zones/2/Actions/Zone.AddEndpoint", 412)]
    assert members(server, "2") == ["I2", "T2", "1"]
    h2.close()


# -- 3. membership the way the schema says ---------------------------------------------------


def test_zone_membership_goes_through_the_actions_never_a_patch(
    mockup: Mockup, proxied: Proxied
) -> None:
    """Behaviour 3. Service: the Mockup Server (public-cxl) behind the proxy refusing a
    PATCH of Links with 400 (DSP0266 "PATCH (update)"; Zone.Links.Endpoints read-only in
    DMTF's schema) and offering #Zone.AddEndpoint/#Zone.RemoveEndpoint (Zone v1.5+) with
    ETags (DSP0266 "ETags"). Both changes carry ZoneETag and EndpointETag."""
    server = mockup("public-cxl")
    proxy = proxied(server, CONFORMING)
    h3 = mapper(cxl_map(proxy.url), "h3")

    assert h3.mappings() == {0: T3, 1: T4}  # T5 (memory) and the switch are not GPUs
    h3.unmap(T4)
    h3.map(T4, 1, generation=2)

    assert writes(proxy) == [
        ("POST", "Zones/3/Actions/Zone.RemoveEndpoint", 204),
        ("POST", "Zones/3/Actions/Zone.AddEndpoint", 204),
    ]
    add = proxy.writes()[1].body
    assert add["Endpoint"] == {"@odata.id": f"{ENDPOINTS}/T4"}
    assert add["ZoneETag"].startswith('"') and add["EndpointETag"].startswith('"')
    assert members(server, "3") == ["I3", "T3", "T5", "1", "T4"]
    h3.close()


def test_a_service_refusing_read_only_patches_without_actions_is_reported_once(
    mockup: Mockup, proxied: Proxied
) -> None:
    """Behaviour 3. Service: the Mockup Server (public-cxl) behind the proxy refusing a
    PATCH of Links with 400 (DSP0266 "PATCH (update)"), with no zone actions: no way to
    change a zone. The map fails, not retried, and is not tried again."""
    server = mockup("public-cxl")
    proxy = proxied(server, Rules(read_only_links=True))
    h3 = mapper(cxl_map(proxy.url), "h3")
    h3.mappings()

    with pytest.raises(DriverError, match="refused to change zone 3 by a PATCH") as first:
        h3.unmap(T4)
    with pytest.raises(DriverError, match=r"refused a PATCH of Links\.Endpoints before"):
        h3.unmap(T4)

    assert not first.value.retryable
    assert writes(proxy) == [("PATCH", "Zones/3", 400)]
    assert members(server, "3") == ["I3", "T3", "T4", "T5", "1"]
    h3.close()


# -- 4. zones holding more than a host port and one GPU --------------------------------------


def test_zones_holding_the_switch_and_other_devices_are_mapped_and_fenced(
    mockup: Mockup, proxied: Proxied
) -> None:
    """Behaviour 4. Service: the Mockup Server (public-cxl: the switch's endpoint 1 in
    every zone; zone 3 holds I3 with T3, T4 and the memory device T5) behind the proxy as a
    conforming service (ETags, read-only Links, zone actions). The broker's fence takes out
    only the GPU; a host fence takes out only the host's GPUs; a port zone takes several."""
    server = mockup("public-cxl")
    proxy = proxied(server, CONFORMING)
    fmap = cxl_map(proxy.url)
    broker = box(fmap)

    broker.fence(T1, generation=1)
    assert members(server, "1") == ["I1", "1"]

    h3 = mapper(fmap, "h3")
    h3.map(T1, 2, generation=2)  # a third GPU in the port's zone, next to the switch
    assert h3.mappings() == {0: T3, 1: T4, 2: T1}
    assert members(server, "3") == ["I3", "T3", "T4", "T5", "1", "T1"]

    fencer = mapper(fmap, "h1")
    assert fencer.fence("h3") == [T1, T3, T4]
    assert members(server, "3") == ["I3", "T5", "1"]
    assert h3.mappings() == {}
    broker.close()
    h3.close()
    fencer.close()


def test_a_fence_on_the_mockup_server_as_it_is_patches_and_keeps_the_switch(
    mockup: Mockup,
) -> None:
    """Behaviour 4. Service: the Mockup Server (public-cxl) as it is: no actions, so the
    zone is changed by PATCH; the switch's endpoint stays."""
    server = mockup("public-cxl")
    broker = box(cxl_map(server.url))
    broker.fence(T3, generation=1)
    assert members(server, "3") == ["I3", "T4", "T5", "1"]
    broker.close()


# -- 5. ETags as a header or only in the payload ---------------------------------------------


@pytest.mark.parametrize("style", ["header", "payload"])
def test_a_stale_etag_is_refused_and_the_change_decided_again(
    mockup: Mockup, proxied: Proxied, style: str
) -> None:
    """Behaviour 5. Service: the Mockup Server (public-cxl) behind the proxy enforcing
    If-Match (DSP0266 "ETags"; RFC 9110 13.1.1) with the ETag given as a header or only as
    @odata.etag; PATCH allowed (no actions). Another client changes zone 3 between the
    fence's read and its write: the If-Match - whichever way the ETag came - is refused
    (412), the zone read again, and the change redone on what is there now."""
    server = mockup("public-cxl")
    proxy = proxied(server, Rules(etags=style))
    broker = box(cxl_map(proxy.url))
    proxy.before_write(lambda: set_members(server, "3", ["I3", "T3", "T4", "1"]))  # T5 left

    broker.fence(T3, generation=1)

    assert writes(proxy) == [("PATCH", "Zones/3", 412), ("PATCH", "Zones/3", 204)]
    stale, fresh = (e.if_match for e in proxy.writes())
    assert stale and fresh and stale != fresh
    assert members(server, "3") == ["I3", "T4", "1"]  # the other client's change survives
    broker.close()


def test_without_etags_the_change_is_unconditional(mockup: Mockup, proxied: Proxied) -> None:
    """Behaviour 5, the other side. Service: the Mockup Server (public-cxl) as it is,
    behind the recording proxy with no rules: it gives no ETag, so none is sent."""
    server = mockup("public-cxl")
    proxy = proxied(server, Rules())
    box(cxl_map(proxy.url)).fence(T3, generation=1)
    assert [e.if_match for e in proxy.writes()] == [""]


# -- 2. task monitors ------------------------------------------------------------------------


def test_a_reset_answered_202_is_followed_to_its_end(mockup: Mockup, proxied: Proxied) -> None:
    """Behaviour 2. Service: the Mockup Server (public-cxl) behind the proxy answering an
    accepted action 202 with an empty body, Location and Retry-After: 1, the monitor 202
    (empty) twice and then the Mockup Server's own 204 (DSP0266 "Asynchronous
    operations"). Scrub returns only after that final answer, and waits as asked."""
    server = mockup("public-cxl")
    proxy = proxied(server, Rules(async_actions=True, retry_after=1, task_polls=2))
    broker = box(cxl_map(proxy.url, scrub=RedfishScrub(actions=(SECURE_ERASE,))))
    broker.fence(T1, generation=1)

    broker.scrub(T1, generation=1)
    returned = time.monotonic()

    posted = [e for e in proxy.log if e.path.endswith("CXLLogicalDevice.PassphraseSecureErase")]
    polls = [e for e in proxy.log if e.path.startswith(MONITORS)]
    assert [e.status for e in posted] == [202]
    assert posted[0].body == dict(SECURE_ERASE.parameters or {})
    assert [e.status for e in polls] == [202, 202, 204]
    assert polls[0].at - posted[0].at >= 1.0 and polls[1].at - polls[0].at >= 1.0
    assert polls[-1].at <= returned
    broker.close()


def test_a_reset_that_does_not_end_in_time_fails_never_succeeds(
    mockup: Mockup, proxied: Proxied
) -> None:
    """Behaviour 2. Service: the Mockup Server (public-cxl) behind the proxy whose task
    monitor keeps answering 202 (DSP0266 "Asynchronous operations"): the deadline
    (task_timeout_s) ends the scrub in failure."""
    server = mockup("public-cxl")
    proxy = proxied(server, Rules(async_actions=True, task_polls=10_000))
    scrub = RedfishScrub(actions=(SECURE_ERASE,))
    broker = box(cxl_map(proxy.url, scrub=scrub, task_timeout_s=1.5))
    broker.fence(T1, generation=1)
    with pytest.raises(BoxFabricError, match=r"did not end within 1.5s \(task monitor"):
        broker.scrub(T1, generation=1)
    broker.close()


# -- 6. what a reset is looked for on, and what is said when there is none -------------------


def test_a_vendor_action_named_in_the_map_resets_on_the_mockup_server(mockup: Mockup) -> None:
    """Behaviour 6. Service: the Mockup Server (public-cxl) as it is, which answers 204 to
    a POST to an action its resource lists. T1's endpoint links its CXL logical device,
    whose action the map names."""
    server = mockup("public-cxl")
    broker = box(cxl_map(server.url, scrub=RedfishScrub(actions=(SECURE_ERASE,))))
    broker.fence(T1, generation=1)
    broker.scrub(T1, generation=1)
    broker.close()


def test_a_gpu_offering_no_reset_is_not_scrubbed_and_the_message_says_why(
    mockup: Mockup,
) -> None:
    """Behaviour 6. Service: the Mockup Server (public-cxl-multiswitch) as it is: T2 is a
    GPU (Processors/GPU) with no Processor.Reset; its CXL logical device and memory chunk
    offer none either."""
    server = mockup("public-cxl-multiswitch")
    broker = box(multiswitch_map(server.url))
    broker.fence(T2, generation=1)
    with pytest.raises(BoxFabricError) as raised:
        broker.scrub(T2, generation=1)
    message = raised.value.args[0]
    assert "looked for #Processor.Reset on its endpoint T2 and the resources it links" in message
    assert "/redfish/v1/Chassis/PooledCXLType2/Processors/GPU" in message
    assert "found none" in message
    assert "PCIeDevice has no Reset action" in message
    broker.close()


# -- sessions, discovery, a service without a fabric -----------------------------------------


def test_a_service_without_a_session_service_takes_basic_authentication(
    mockup: Mockup,
) -> None:
    """Service: the Mockup Server (public-cxl-multiswitch) as it is: no SessionService.
    A session login fails saying to use Basic; with Basic the map checks out - including
    I5, which the mockup leaves out of its Endpoints collection."""
    server = mockup("public-cxl-multiswitch")
    with pytest.raises(RedfishLoginError, match=r"set service\.auth: basic"):
        RedfishSession(service(server.url))
    checked = connect_redfish_mapper(multiswitch_map(server.url), "h5")
    assert checked.mappings() == {0: T5}
    checked.close()


def test_a_service_without_the_fabric_is_refused_at_discovery(mockup: Mockup) -> None:
    """Service: the Mockup Server (public-expansion-box) as it is: a PCIe expansion
    chassis with a session service but no Fabrics. The map is refused with what the
    service has; the broker's fence says the endpoint is not there."""
    server = mockup("public-expansion-box")
    fmap = cxl_map(server.url)
    with pytest.raises(DriverError, match="has no Fabrics collection at all") as raised:
        connect_redfish_mapper(fmap, "h1")
    assert not raised.value.retryable
    with pytest.raises(BoxFabricError, match=r"names endpoint T1 for .* does not have"):
        box(fmap).fence(T1, generation=1)
