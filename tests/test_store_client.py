from __future__ import annotations

import pytest

from dxpool.errors import InvalidArgument
from dxpool.store.client import EtcdAddress, connect, parse_endpoints, pause_left_s


def test_endpoints_parse() -> None:
    assert parse_endpoints("127.0.0.1:2379, http://127.0.0.1:2380") == [
        EtcdAddress("127.0.0.1", 2379),
        EtcdAddress("127.0.0.1", 2380),
    ]


@pytest.mark.parametrize(
    "value",
    ["127.0.0.1:\u00b3", "127.0.0.1:\u0663", "127.0.0.1:" + "9" * 5000, "127.0.0.1:0", ":2379"],
)
def test_ports_are_ascii_digits_in_range(value: str) -> None:
    with pytest.raises(InvalidArgument, match="host:port"):
        parse_endpoints(value)


def test_pause_left_is_the_shortest_member_pause() -> None:
    client = connect("127.0.0.1:1,127.0.0.1:2", retry_after_s=0.5)
    try:
        assert pause_left_s(client) == 0.0
        first, second = client.endpoints.values()
        first.fail()
        assert pause_left_s(client) == 0.0  # the second member can be called now
        second.fail()
        first.last_failed -= 0.3  # the first failed earlier: its pause ends first
        assert 0.1 < pause_left_s(client) <= 0.2 + 0.01
    finally:
        client.close()
