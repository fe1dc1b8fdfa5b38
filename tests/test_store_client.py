from __future__ import annotations

import pytest

from dxpool.errors import InvalidArgument
from dxpool.store.client import EtcdAddress, parse_endpoints


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
