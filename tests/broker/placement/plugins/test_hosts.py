"""Host filters and their one-line accounts of what they dropped."""

from __future__ import annotations

import random
from collections.abc import Iterable

from dxpool.broker.placement.model import HostInfo, Place, PlacementRequest, ResourceScale
from dxpool.broker.placement.plugins.hosts import (
    HostAlive,
    HostLabels,
    HostNotExcluded,
    HostResources,
    HostSlots,
    PinnedHost,
)
from dxpool.broker.placement.status import Code


def host(name: str, slots: int = 8, used: Iterable[int] = (), alive: bool = True) -> HostInfo:
    return HostInfo(name, Place(f"hosts/{name}"), slots, frozenset(used), alive)


def test_pinned_host_keeps_only_the_pin() -> None:
    plugin = PinnedHost()
    request = PlacementRequest("", 1, host="h1")
    assert plugin.applies(request)
    assert plugin.filter_host(request, host("h1")).ok
    assert plugin.filter_host(request, host("h2")).reasons == ("not the pinned host hosts/h1",)
    assert not plugin.applies(PlacementRequest("", 1))
    assert plugin.explain(request, [host("h2")], 2) is None


def test_alive() -> None:
    plugin = HostAlive()
    request = PlacementRequest("", 1)
    assert plugin.filter_host(request, host("h1")).ok
    status = plugin.filter_host(request, host("h1", alive=False))
    assert status.code is Code.UNSCHEDULABLE
    assert status.reasons == ("not alive: its agent holds no session",)


def test_alive_explains_one_some_or_all() -> None:
    plugin = HostAlive()
    request = PlacementRequest("", 1)
    dead = [host(f"h{i}", alive=False) for i in range(5)]
    assert plugin.explain(request, dead[:1], 1) == (
        "hosts: hosts/h0 is not alive (its agent holds no session)"
    )
    assert plugin.explain(request, dead[:2], 2) == "hosts: none of the 2 hosts is alive"
    assert plugin.explain(request, dead, 9) == (
        "hosts: 5 of 9 not alive (hosts/h0, hosts/h1, hosts/h2 and 2 more)"
    )
    assert plugin.explain(request, [], 3) is None


def test_slots_count_only_free_slots_within_capacity() -> None:
    plugin = HostSlots()
    request = PlacementRequest("", 3)
    assert plugin.filter_host(request, host("h1", 4, used=[0, 7])).ok  # 7 is out of range
    assert plugin.filter_host(request, host("h1", 4, used=[0, 1])).reasons == (
        "2 free proxy slots, 3 needed",
    )
    assert plugin.filter_host(request, host("h1", 4, used=[0, 1, 2])).reasons == (
        "1 free proxy slot, 3 needed",
    )


def test_slots_explain_names_the_roomiest_host() -> None:
    plugin = HostSlots()
    request = PlacementRequest("", 4)
    one = [host("h1", 8, used=range(6))]
    assert plugin.explain(request, one, 1) == (
        "host capacity: hosts/h1 has 2 free proxy slots, 4 needed"
    )
    some = [host("h1", 8, used=range(6)), host("h2", 8, used=range(5)), host("h3", 2)]
    assert plugin.explain(request, some, 5) == (
        "host capacity: 3 of 5 hosts have fewer than 4 free proxy slots; the most is 3 on hosts/h2"
    )
    full = [host("h1", 2, used=[0, 1]), host("h2", 1, used=[0])]
    assert plugin.explain(request, full, 2) == "hosts: no alive host has a free slot"
    assert plugin.explain(request, [], 2) is None


def labelled(name: str, **labels: str) -> HostInfo:
    return HostInfo(name, Place(f"hosts/{name}"), 8, frozenset(), True, frozenset(labels.items()))


def test_labels_keep_hosts_holding_every_selected_pair() -> None:
    plugin = HostLabels()
    request = PlacementRequest("", 1, host_selector=frozenset({("env", "prod"), ("zone", "a")}))
    assert plugin.applies(request) and not plugin.applies(PlacementRequest("", 1))
    assert plugin.filter_host(request, labelled("h1", env="prod", zone="a", extra="x")).ok
    dropped = plugin.filter_host(request, labelled("h2", env="prod", zone="b"))
    assert dropped.code is Code.UNSCHEDULABLE
    assert dropped.reasons == ("labels lack zone=a",)
    failed = [labelled("h2", env="prod", zone="b"), labelled("h3")]
    assert plugin.explain(request, failed, 3) == (
        "host labels: 2 of 3 hosts do not have env=prod, zone=a; the closest, hosts/h2, "
        "lacks zone=a; label hosts with the agent's --label or change --host-selector"
    )
    assert plugin.explain(request, failed[:1], 1) == (
        "host labels: hosts/h2 does not have env=prod, zone=a"
    )


def sized(
    name: str, cores: int, memory: int, used_cores: int = 0, used_memory: int = 0
) -> HostInfo:
    return HostInfo(
        name,
        Place(f"hosts/{name}"),
        8,
        frozenset(),
        True,
        frozenset(),
        cores,
        memory,
        used_cores,
        used_memory,
    )


def test_resources_keep_hosts_with_the_cpus_and_memory_free() -> None:
    plugin = HostResources()
    request = PlacementRequest("", 1, cpu_cores=8, host_memory_mib=32768)
    assert plugin.applies(request) and not plugin.applies(PlacementRequest("", 1))
    assert plugin.filter_host(request, sized("h1", 16, 65536, 8, 32768)).ok
    assert plugin.filter_host(request, sized("h2", 16, 65536, 9, 40960)).reasons == (
        "7 free CPU cores, 8 needed; 24GiB free memory, 32GiB needed",
    )
    assert plugin.filter_host(request, sized("h3", 0, 0)).reasons == (
        "declares no CPU cores; declares no memory",
    )
    failed = [sized("h2", 16, 65536, 9, 40960), sized("h3", 0, 0)]
    assert plugin.explain(request, failed, 2) == (
        "host resources: 2 of 2 hosts lack 8 free CPU cores and 32GiB free memory; the "
        "roomiest, hosts/h2, has 7 free CPU cores and 24GiB free memory; ask for less, or "
        "declare more with the agent's --cpus and --memory"
    )
    assert plugin.explain(request, failed[1:], 1) == (
        "host resources: hosts/h3: declares no CPU cores; declares no memory"
    )


def test_excluded_hosts_are_dropped_and_counted() -> None:
    plugin = HostNotExcluded()
    request = PlacementRequest("", 1, exclude_hosts=frozenset({"h1", "h2"}))
    assert plugin.applies(request)
    assert not plugin.applies(PlacementRequest("", 1))
    assert plugin.filter_host(request, host("h3")).ok
    assert plugin.filter_host(request, host("h1")).reasons == ("excluded by the request",)
    assert not plugin.keeps(request, host("h1")) and plugin.keeps(request, host("h3"))
    assert plugin.explain(request, [host("h1")], 1) == "hosts: hosts/h1 is excluded by the request"
    assert plugin.explain(request, [host("h1"), host("h2")], 5) == (
        "hosts: 2 of 5 excluded by the request (hosts/h1, hosts/h2)"
    )


def test_checks_at_decision_time_agree_with_the_filters_and_their_least_room() -> None:
    """``keeps`` says yes exactly when ``filter_host`` does, and no host kept has less
    room than ``least_room``: placement applies them host by host on carried groups."""
    rng = random.Random(3)
    resources, excluded = HostResources(), HostNotExcluded()
    scale = ResourceScale(128, 786432)
    for _ in range(2000):
        cpus, memory = rng.choice(((0, 0), (16, 65536), (128, 786432), (64, 0), (0, 1024)))
        sized = HostInfo(
            f"h{rng.randrange(5)}",
            Place("hosts/h"),
            8,
            frozenset(),
            True,
            cpu_cores=cpus,
            memory_mib=memory,
            used_cpu_cores=rng.randint(0, cpus),
            used_memory_mib=rng.randint(0, memory),
        )
        request = PlacementRequest(
            "",
            1,
            cpu_cores=rng.choice((0, 1, 8, 64, 200)),
            host_memory_mib=rng.choice((0, 512, 65536, 900_000)),
            exclude_hosts=frozenset(rng.sample(["h0", "h1", "h2", "h3", "h4"], 2)),
        )
        for plugin in (resources, excluded):
            assert plugin.keeps(request, sized) == plugin.filter_host(request, sized).ok
        if resources.keeps(request, sized):
            assert scale.room(sized) >= resources.least_room(request, scale)
