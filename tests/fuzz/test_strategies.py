"""The descriptor-built strategies reach every field of every request, so a field added
to a .proto file is fuzzed without touching the suite."""

from __future__ import annotations

import pytest
from google.protobuf.message import Message
from hypothesis import HealthCheck, given, settings

from tests.fuzz import rpcs
from tests.fuzz.strategies import field_paths, requests

NAMES = sorted(rpcs.METHODS)


def _set_fields(message: Message, prefix: str = "") -> set[str]:
    found = set()
    for field, value in message.ListFields():  # only fields holding a non-default value
        found.add(prefix + field.name)
        if field.message_type is not None and isinstance(value, Message):
            found |= _set_fields(value, f"{prefix}{field.name}.")
    return found


@pytest.mark.parametrize("name", NAMES)
def test_every_field_gets_a_value(name: str) -> None:
    method = rpcs.METHODS[name]
    seen: set[str] = set()

    @settings(
        max_examples=100,
        database=None,
        derandomize=True,
        suppress_health_check=[HealthCheck.too_slow],
    )
    @given(request=requests(method.input_type, rpcs.BASELINES[name]))
    def draw(request: Message) -> None:
        seen.update(_set_fields(request))

    draw()
    top_level = {field.name for field in method.input_type.fields}
    assert top_level <= seen, top_level - seen
    reachable = {".".join(f.name for f in path) for path in field_paths(method.input_type)}
    assert len(seen & reachable) >= 0.8 * len(reachable), sorted(reachable - seen)
