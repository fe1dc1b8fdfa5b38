"""A host for CPU cores and memory alone: the host filters decide, the fullest slots win."""

from __future__ import annotations

from dataclasses import replace

import pytest

from dxpool.broker.placement.reserve import HostRequest, choose_host
from dxpool.errors import InvalidArgument, NotFound

from .pools import Pool


def sized(pool: Pool, host: str, cpus: int, memory_mib: int, held: int = 0) -> Pool:
    pool.hosts[host] = replace(
        pool.hosts[host], cpu_cores=cpus, memory_mib=memory_mib, used_cpu_cores=held
    )
    return pool


def test_the_host_with_the_fewest_free_slots_then_the_least_room_takes_it() -> None:
    pool = Pool().host("empty").host("full", used=range(8)).host("half", used=range(4))
    pool.host("full2", used=range(8))
    sized(pool, "empty", 8, 1024)
    sized(pool, "full", 64, 262144)
    sized(pool, "full2", 32, 131072)  # as full as "full", less room
    sized(pool, "half", 16, 65536)
    snapshot = pool.snapshot()
    assert choose_host(HostRequest(4, 1024), snapshot).host == "full2"
    assert choose_host(HostRequest(40), snapshot).host == "full"  # full2 lacks the CPU
    assert choose_host(HostRequest(60, 200_000), snapshot).host == "full"


def test_labels_exclusions_liveness_and_a_pin_apply_as_for_a_node() -> None:
    pool = Pool().host("h1").host("h2").host("dead", alive=False)
    for host in ("h1", "h2", "dead"):
        sized(pool, host, 32, 65536)
    pool.hosts["h2"] = replace(pool.hosts["h2"], labels=frozenset({("zone", "b")}))
    snapshot = pool.snapshot()
    assert choose_host(HostRequest(4), snapshot).host == "h1"
    assert choose_host(HostRequest(4, exclude_hosts=frozenset({"h1"})), snapshot).host == "h2"
    selector = frozenset({("zone", "b")})
    assert choose_host(HostRequest(4, host_selector=selector), snapshot).host == "h2"
    assert choose_host(HostRequest(4, host="h2"), snapshot).host == "h2"
    with pytest.raises(NotFound):
        choose_host(HostRequest(4, host="h9"), snapshot)


def test_when_no_host_holds_it_each_filter_says_why() -> None:
    pool = Pool().host("h1").host("h2").host("dead", alive=False).host("bare")
    sized(pool, "h1", 16, 65536, held=12)
    sized(pool, "h2", 8, 65536)
    choice = choose_host(HostRequest(10), pool.snapshot())
    assert choice.host is None
    assert choice.unsatisfied == (
        "hosts: 1 of 4 not alive (hosts/dead)",
        "host resources: 3 of 3 hosts lack 10 free CPU cores; the roomiest, hosts/h2, has "
        "8 free CPU cores and 64GiB free memory; ask for less, or declare more with the "
        "agent's --cpus and --memory",
    )
    assert choose_host(HostRequest(1), Pool().snapshot()).unsatisfied == ("no host is registered",)


def test_a_request_for_nothing_or_too_much_is_refused() -> None:
    with pytest.raises(InvalidArgument, match="set cpu_cores or host_memory_mib"):
        HostRequest(0, 0)
    with pytest.raises(InvalidArgument, match="cpu_cores -1 is out of range"):
        HostRequest(-1)
    with pytest.raises(InvalidArgument, match="invalid host id"):
        HostRequest(1, host="hosts/h1")
    with pytest.raises(InvalidArgument, match="invalid host id"):
        HostRequest(1, exclude_hosts=frozenset({"hosts/h1"}))
    many = frozenset(f"h{i}" for i in range(5000))  # in process, as many as anti-affinity finds
    assert HostRequest(1, exclude_hosts=many).exclude_hosts == many
