"""Output formats: tables, JSON/YAML as protobuf renders it, names, and streamed rows."""

from __future__ import annotations

import json

import pytest
import yaml
from google.protobuf.timestamp_pb2 import Timestamp

from dxpool.api.v1 import nodes_pb2
from dxpool.api.v1 import resources_pb2 as pb
from dxpool.cli.output import (
    OutputFormat,
    StreamPrinter,
    format_table,
    print_many,
    print_one,
)
from dxpool.cli.views import (
    BOX_VIEW,
    HOST_VIEW,
    NODE_STREAM_WIDTHS,
    NODE_VIEW,
    age,
    gpu_request,
    location,
    memory,
    short,
)


def make_box(box_id: str = "box1", **fields: object) -> pb.Box:
    return pb.Box(
        name=f"boxes/{box_id}",
        location=pb.Location(site="dc1", pod="p1", rack="r1"),
        state=pb.BOX_STATE_ACTIVE,
        gpu_count=8,
        **fields,  # type: ignore[arg-type]
    )


def make_node() -> pb.VirtualNode:
    return pb.VirtualNode(
        name="nodes/n1",
        host="hosts/h1",
        state=pb.NODE_STATE_READY,
        spec=pb.NodeSpec(gpus=pb.GpuRequest(model="H100", count=2), tenant="ml"),
        gpus=[
            pb.GpuBinding(gpu="boxes/box1/gpus/0", latency_ns=1700),
            pb.GpuBinding(gpu="boxes/box2/gpus/3", latency_ns=2700),
        ],
    )


def test_table_is_plain_columns_without_trailing_blanks() -> None:
    text = format_table(["name", "state"], [["box1", "Active"], ["a-much-longer-name", "x"]])
    lines = text.splitlines()
    assert lines[0].split() == ["NAME", "STATE"]
    assert all(line == line.rstrip() for line in lines)
    assert "\x1b[" not in text  # no colour when stdout is not a terminal
    assert lines[1].index("Active") == lines[2].index("x") == lines[0].index("STATE")


def test_table_never_squeezes_wide_rows() -> None:
    cell = "x" * 300
    assert cell in format_table(["wide"], [[cell]])


def test_box_table_and_wide(capsys: pytest.CaptureFixture[str]) -> None:
    print_many([make_box(labels={"team": "ml"}, gpus_free=5)], BOX_VIEW, OutputFormat.TABLE)
    table = capsys.readouterr().out.splitlines()
    assert table[0].split() == ["NAME", "STATE", "GPUS", "FREE/TOTAL", "LOCATION", "AGE"]
    assert table[1].split() == ["box1", "Active", "5/8", "dc1/p1/r1", "<none>"]

    print_many([make_box(labels={"team": "ml"})], BOX_VIEW, OutputFormat.WIDE)
    wide = capsys.readouterr().out.splitlines()
    assert wide[0].split()[-3:] == ["FABRIC-ENDPOINT", "LABELS", "CORDON-REASON"]
    assert "team=ml" in wide[1]


def test_json_is_protobuf_json_mapping(capsys: pytest.CaptureFixture[str]) -> None:
    print_one(make_box(), BOX_VIEW, OutputFormat.JSON)
    data = json.loads(capsys.readouterr().out)
    assert data == {
        "name": "boxes/box1",
        "location": {"site": "dc1", "pod": "p1", "rack": "r1"},
        "state": "BOX_STATE_ACTIVE",
        "gpuCount": 8,
    }


def test_lists_print_as_lists(capsys: pytest.CaptureFixture[str]) -> None:
    print_many([make_box("box1"), make_box("box2")], BOX_VIEW, OutputFormat.JSON)
    assert [b["name"] for b in json.loads(capsys.readouterr().out)] == ["boxes/box1", "boxes/box2"]
    print_many([make_box("box1")], BOX_VIEW, OutputFormat.YAML)
    assert yaml.safe_load(capsys.readouterr().out)[0]["gpuCount"] == 8
    print_many([], BOX_VIEW, OutputFormat.JSON)
    assert json.loads(capsys.readouterr().out) == []


def test_yaml_one_object(capsys: pytest.CaptureFixture[str]) -> None:
    print_one(make_node(), NODE_VIEW, OutputFormat.YAML)
    data = yaml.safe_load(capsys.readouterr().out)
    assert data["state"] == "NODE_STATE_READY"
    assert data["gpus"][1] == {"gpu": "boxes/box2/gpus/3", "latencyNs": "2700"}


def test_name_output(capsys: pytest.CaptureFixture[str]) -> None:
    print_many([make_box("box1"), make_box("box2")], BOX_VIEW, OutputFormat.NAME)
    assert capsys.readouterr().out == "boxes/box1\nboxes/box2\n"


def test_empty_table_says_so_on_stderr(capsys: pytest.CaptureFixture[str]) -> None:
    print_many([], BOX_VIEW, OutputFormat.TABLE)
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err == "no boxes found\n"


def test_node_row_shows_request_and_worst_latency(capsys: pytest.CaptureFixture[str]) -> None:
    print_one(make_node(), NODE_VIEW, OutputFormat.WIDE)
    row = capsys.readouterr().out.splitlines()[1].split()
    assert row[:5] == ["n1", "Ready", "h1", "H100:2", "2.7us"]
    assert "box1/0,box2/3" in row


def test_stream_printer_rows_line_up(capsys: pytest.CaptureFixture[str]) -> None:
    printer = StreamPrinter(NODE_VIEW, OutputFormat.TABLE, NODE_STREAM_WIDTHS)
    node = make_node()
    printer.emit(node)
    node.state = pb.NODE_STATE_RELEASING
    printer.emit(node)
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 3
    assert lines[0].startswith("NAME")
    assert lines[1].index("Ready") == lines[2].index("Releasing") == lines[0].index("STATE")


def test_stream_printer_json_lines(capsys: pytest.CaptureFixture[str]) -> None:
    printer = StreamPrinter(NODE_VIEW, OutputFormat.JSON)
    event = nodes_pb2.NodeEvent(type=nodes_pb2.NodeEvent.TYPE_CHANGED, node=make_node())
    printer.emit(event.node, event)
    printer.emit(event.node, event)
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 2
    assert json.loads(lines[0])["type"] == "TYPE_CHANGED"
    assert json.loads(lines[1])["node"]["name"] == "nodes/n1"


@pytest.mark.parametrize(
    ("seconds_ago", "expected"),
    [(5, "5s"), (59, "59s"), (60, "1m"), (3599, "59m"), (7200, "2h"), (3 * 86_400, "3d")],
)
def test_age(seconds_ago: int, expected: str) -> None:
    assert age(Timestamp(seconds=1_000_000), now=1_000_000 + seconds_ago) == expected


def test_cell_formatters() -> None:
    assert age(Timestamp()) == "<none>"
    assert memory(81920) == "80GiB"
    assert memory(1536) == "1536MiB"
    assert short("boxes/box1/gpus/3") == "box1/3"
    assert short("hosts/h1") == "h1"
    assert short("") == "<none>"
    assert location(pb.Location(site="dc1")) == "dc1"
    assert location(pb.Location()) == "<none>"
    assert gpu_request(pb.GpuRequest(count=2, min_memory_mib=40960)) == "*:2(>=40GiB)"


def test_host_table_says_slots_used_of_total_and_wide_names_them(
    capsys: pytest.CaptureFixture[str],
) -> None:
    host = pb.Host(name="hosts/h1", alive=True, slot_capacity=8, slots_used=2)
    host.used_slots.extend([0, 3])
    print_many([host], HOST_VIEW, OutputFormat.TABLE)
    table = capsys.readouterr().out.splitlines()
    assert table[0].split()[:4] == ["NAME", "ALIVE", "SLOTS", "USED/TOTAL"]
    assert table[1].split()[:3] == ["h1", "yes", "2/8"]
    print_many([host], HOST_VIEW, OutputFormat.WIDE)
    wide = capsys.readouterr().out.splitlines()
    column = wide[0].index("USED-SLOTS")
    assert wide[1][column:].split()[0] == "0,3"
