"""The key=value log lines of the broker, the agent and the CLI."""

from __future__ import annotations

import logging

from dxpool.logs import KeyValueFormatter


def format_record(message: str, **extra: object) -> str:
    record = logging.LogRecord("dxpool.test", logging.INFO, __file__, 1, message, None, None)
    record.__dict__.update(extra)
    return KeyValueFormatter().format(record)


def test_extra_fields_follow_the_constant_message() -> None:
    line = format_record("gpu attached", gpu="boxes/b1/gpus/0", host_slot=2)

    assert line.endswith("INFO dxpool.test gpu attached gpu=boxes/b1/gpus/0 host_slot=2")


def test_values_with_spaces_or_quotes_are_quoted() -> None:
    line = format_record("gpu attach failed", error='map failed: "busy"')

    assert line.endswith('error="map failed: \\"busy\\""')


def test_a_record_without_extra_fields_is_just_the_message() -> None:
    assert format_record("agent started").endswith("INFO dxpool.test agent started")
