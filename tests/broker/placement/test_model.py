"""The placement data model: request validation and host slot arithmetic."""

from __future__ import annotations

import pytest

from dxpool.broker.placement.model import HostInfo, Place, PlacementRequest
from dxpool.errors import InvalidArgument


def test_a_valid_request_keeps_its_fields() -> None:
    request = PlacementRequest(
        "H100",
        4,
        min_memory_mib=81920,
        host="h1",
        max_latency_ns=4_000,
        exclude_gpus=frozenset({"boxes/b1/gpus/0"}),
    )
    assert (request.model, request.count, request.host) == ("H100", 4, "h1")


def test_a_set_naming_a_model_twice_is_held_with_each_named_once() -> None:
    request = PlacementRequest("V100M16|V100M32|v100m32", 1)
    assert request.model == "V100M16|V100M32"
    assert request.models == ("V100M16", "V100M32")
    assert request == PlacementRequest("V100M16|V100M32", 1)  # one key for placement


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"count": 0}, "invalid GPU count 0: a node takes 1 to 64 GPUs"),
        ({"count": 65}, "invalid GPU count 65"),
        ({"model": "H 100"}, "invalid GPU model 'H 100'"),
        ({"min_memory_mib": -1}, "invalid minimum GPU memory -1 MiB"),
        ({"host": "hosts/h1"}, "invalid host id 'hosts/h1'"),
        ({"host": ""}, "invalid host id ''"),
        ({"max_latency_ns": -5}, "invalid max_latency_ns -5: must be 0"),
        ({"exclude_gpus": frozenset({"b1/3"})}, "invalid gpu name 'b1/3'"),
        ({"exclude_gpus": {"boxes/b1/gpus/0"}}, "exclude_gpus must be a frozenset"),
    ],
)
def test_an_invalid_request_names_the_field_to_fix(kwargs: dict[str, object], message: str) -> None:
    fields: dict[str, object] = {"model": "H100", "count": 1, **kwargs}
    with pytest.raises(InvalidArgument, match=message.replace("(", r"\(")):
        PlacementRequest(**fields)  # type: ignore[arg-type]


def test_free_slots_are_the_lowest_unused_within_capacity() -> None:
    host = HostInfo("h1", Place("hosts/h1"), 6, frozenset({0, 2, 9, -1}), True)
    assert host.free_slots() == [1, 3, 4, 5]
    assert host.free_slot_count() == 4
    assert HostInfo("h2", Place("hosts/h2"), 0, frozenset(), True).free_slot_count() == 0
