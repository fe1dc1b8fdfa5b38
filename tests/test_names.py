from __future__ import annotations

import pytest

from dxpool.errors import InvalidArgument
from dxpool.names import GpuRef, check_request_id, parse_box, parse_gpu, parse_host, parse_node


def test_round_trips() -> None:
    assert parse_box("boxes/box-1") == "box-1"
    assert parse_host("hosts/h1") == "h1"
    assert parse_node("nodes/node-ab12") == "node-ab12"
    assert parse_gpu("boxes/b1/gpus/7") == GpuRef("b1", 7)
    assert GpuRef("b1", 7).name == "boxes/b1/gpus/7"


@pytest.mark.parametrize(
    "name",
    ["box/b1", "boxes/", "boxes/B1", "boxes/1b", "boxes/b-", "boxes/" + "b" * 64, "boxes/b/c"],
)
def test_bad_box_names(name: str) -> None:
    with pytest.raises(InvalidArgument, match="boxes/"):
        parse_box(name)


@pytest.mark.parametrize("name", ["boxes/b1/gpus/x", "boxes/b1/gpu/1", "boxes/b1/gpus/99999"])
def test_bad_gpu_names(name: str) -> None:
    with pytest.raises(InvalidArgument):
        parse_gpu(name)


def test_oversized_values_are_truncated_in_messages() -> None:
    with pytest.raises(InvalidArgument) as error:
        parse_host("hosts/" + "x" * 10_000)
    assert len(str(error.value)) < 400


def test_request_ids() -> None:
    assert check_request_id("") == ""
    assert check_request_id("req-1:a.b_c") == "req-1:a.b_c"
    with pytest.raises(InvalidArgument):
        check_request_id("has space")


@pytest.mark.parametrize(
    "name",
    [
        "boxes/b1/gpus/\u00b3",  # superscript three: str.isdigit() is True, int() fails
        "boxes/b1/gpus/\u00b2",
        "boxes/b1/gpus/\u0663",  # ARABIC-INDIC DIGIT THREE: int() reads it as 3
        "boxes/b1/gpus/" + "9" * 5000,  # more digits than int() converts
        "boxes/b1/gpus/4096",
        "boxes/b1/gpus/-1",
        "boxes/b1/gpus/+1",
        "boxes/b1/gpus/ 1",
        "boxes/b1/gpus/1\n",
        "boxes/b1/gpus/",
    ],
)
def test_gpu_slots_are_ascii_digits_in_range(name: str) -> None:
    with pytest.raises(InvalidArgument, match="0-4095") as error:
        parse_gpu(name)
    assert len(str(error.value)) < 400


@pytest.mark.parametrize(
    ("parse", "name"),
    [
        (parse_box, "boxes/a\n"),
        (parse_host, "hosts/a\n"),
        (parse_node, "nodes/a\n"),
        (parse_box, "boxes/a\r"),
        (parse_gpu, "boxes/a\n/gpus/1"),
    ],
)
def test_a_trailing_newline_is_not_part_of_an_id(parse, name: str) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(InvalidArgument):
        parse(name)


def test_request_ids_reject_a_trailing_newline() -> None:
    with pytest.raises(InvalidArgument):
        check_request_id("r1\n")
