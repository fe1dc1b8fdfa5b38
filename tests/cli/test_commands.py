"""The ``dxpool`` commands against a real broker, real etcd and host agents as processes."""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING
from xml.etree import ElementTree

import pytest
import yaml
from click.testing import CliRunner, Result

from dxpool.api.v1 import resources_pb2 as pb
from dxpool.cli import picture
from dxpool.cli.main import cli
from dxpool.client import Client
from dxpool.store.keys import KeySchema
from tests.conftest import SimPool, Stubs, register_sim_box, wait_until
from tests.patience import patient

if TYPE_CHECKING:
    from dxpool.broker.api.server import BrokerServer

Run = Callable[..., Result]


@pytest.fixture
def run(broker: BrokerServer, monkeypatch: pytest.MonkeyPatch) -> Run:
    """Runs ``dxpool --endpoint <broker> ARGS...`` in-process."""
    monkeypatch.delenv("DXPOOL_ENDPOINT", raising=False)
    runner = CliRunner()

    def invoke(*args: str) -> Result:
        return runner.invoke(cli, ["--endpoint", broker.endpoint, *args])

    return invoke


@pytest.fixture
def pool(broker: BrokerServer, stubs: Stubs, sim_pool: SimPool) -> SimPool:
    """Boxes box1 (rack r1) and box2 (rack r2) of four H100s; host h1 alive on rack r1."""
    register_sim_box(sim_pool, stubs, "box1", gpus=4, rack="r1")
    register_sim_box(sim_pool, stubs, "box2", gpus=4, rack="r2")
    sim_pool.start_agent("h1", rack="r1")
    with Client(broker.endpoint) as client:
        wait_until(lambda: any(h.alive for h in client.list_hosts()), message="h1 alive")
    return sim_pool


def ok(result: Result) -> str:
    assert result.exit_code == 0, f"exit {result.exit_code}: {result.output}"
    return result.stdout


def test_box_add_list_cordon_delete(run: Run) -> None:
    args = shlex.split("box add box1 --gpus H100:8 --memory 80GiB --site dc1 --pod p1 --rack r1")
    added = ok(run(*args))
    assert added.splitlines()[1].split()[:4] == ["box1", "Active", "8/8", "dc1/p1/r1"]
    ok(run(*shlex.split("box add box2 --gpus 4 --model A100 --memory 40GiB --label row=2 -o name")))

    listed = json.loads(ok(run("box", "list", "-o", "json")))
    assert [b["name"] for b in listed] == ["boxes/box1", "boxes/box2"]
    assert listed[1]["labels"] == {"row": "2"}

    assert ok(run("box", "cordon", "box1", "--reason", "fan")) == "boxes/box1 cordoned\n"
    got = yaml.safe_load(ok(run("box", "get", "box1", "-o", "yaml")))
    assert got["state"] == "BOX_STATE_CORDONED" and got["cordonReason"] == "fan"
    assert ok(run("box", "uncordon", "boxes/box1")) == "boxes/box1 uncordoned\n"

    free = ok(run("gpu", "list", "--box", "box2", "--state", "free", "-o", "name")).split()
    assert free == [f"boxes/box2/gpus/{i}" for i in range(4)]
    assert ok(run("box", "delete", "box1", "box2")) == "boxes/box1 deleted\nboxes/box2 deleted\n"
    empty = run("box", "list")
    assert ok(empty) == "" and "no boxes found" in empty.stderr


def test_box_add_twice_is_already_exists(run: Run) -> None:
    args = shlex.split("box add box1 --gpus H100:2 --memory 80GiB")
    ok(run(*args))
    again = run(*args)
    assert again.exit_code == 1
    assert again.stderr.startswith("error: ALREADY_EXISTS: ")


def test_node_create_wait_ready_then_delete_wait_released(run: Run, pool: SimPool) -> None:
    created = run(
        *shlex.split("node create --gpus H100:2 --max-latency 50us --name n1 --wait -o json")
    )
    node = json.loads(ok(created))
    assert node["name"] == "nodes/n1"
    assert node["state"] == "NODE_STATE_READY"
    assert node["host"] == "hosts/h1"
    assert len(node["gpus"]) == 2
    assert "waiting up to 120s for nodes/n1 to become READY" in created.stderr

    table = ok(run("node", "list")).splitlines()
    assert table[0].split() == ["NAME", "STATE", "HOST", "GPUS", "LATENCY", "AGE"]
    assert table[1].split()[:4] == ["n1", "Ready", "h1", "H100:2"]
    hosts = ok(run("host", "list")).splitlines()
    assert hosts[1].split()[:3] == ["h1", "yes", "2/8"]
    attached = ok(run("gpu", "list", "--state", "attached", "-o", "wide")).splitlines()
    assert len(attached) == 3 and all("n1" in line for line in attached[1:])

    assert ok(run("node", "delete", "n1", "--wait")) == "nodes/n1 released\n"
    assert ok(run("node", "list", "-o", "name")) == ""
    assert ok(run("node", "list", "--all", "-o", "name")) == "nodes/n1\n"
    assert ok(run("node", "delete", "n1")) == "nodes/n1 released\n"  # idempotent


def test_node_create_on_unknown_host_is_not_found(run: Run, pool: SimPool) -> None:
    result = run("node", "create", "--gpus", "H100:1", "--host", "nope")
    assert result.exit_code == 1
    assert result.stderr.startswith("error: NOT_FOUND: ")
    assert result.stdout == ""


def test_node_create_that_cannot_fit_points_at_plan(run: Run, pool: SimPool) -> None:
    result = run("node", "create", "--gpus", "H100:16")
    assert result.exit_code == 1
    assert result.stderr.startswith("error: RESOURCE_EXHAUSTED: ")
    assert "`dxpool node plan`" in result.stderr  # in the broker's message or in our hint


def test_node_plan_shows_placement_and_candidates(run: Run, pool: SimPool) -> None:
    text = ok(run("node", "plan", "--gpus", "H100:2"))
    assert text.startswith("placement: h1\n")
    assert "GPU" in text and "FEASIBLE" in text
    plan = json.loads(ok(run("node", "plan", "--gpus", "H100:2", "-o", "json")))
    assert plan["host"] == "hosts/h1" and len(plan["gpus"]) == 2
    assert ok(run("node", "list", "-o", "name")) == ""  # nothing committed


def test_node_plan_with_a_slowdown_bound_explains_the_boxes_too_far(
    run: Run, pool: SimPool
) -> None:
    # h1 sits in rack r1: box1 is 2.9us away, box2 (rack r2) 4.4us; inference-online at
    # 1.07 allows 3.5us, so only box1's four GPUs are within reach
    fits = json.loads(
        ok(
            run(
                *shlex.split(
                    "node plan --gpus H100:4 --max-slowdown 1.07 --workload inference-online "
                    "-o json"
                )
            )
        )
    )
    assert {g["gpu"].split("/gpus/")[0] for g in fits["gpus"]} == {"boxes/box1"}
    text = ok(
        run(*shlex.split("node plan --gpus H100:5 --max-slowdown 1.07 --workload inference-online"))
    )
    assert text.startswith("placement: nothing fits now\n")
    assert "max_slowdown 1.07 for workload inference-online" in text
    assert "nearest left out: boxes/box2 (4 GPUs) at 4.4us" in text
    refused = run(*shlex.split("node create --gpus H100:5 --max-slowdown 1.07 --workload 100@5ms"))
    assert refused.exit_code == 1
    assert refused.stderr.startswith("error: RESOURCE_EXHAUSTED: ")
    assert "at most 1.07x slower for 100@5ms" in refused.stderr


def test_node_slowdown_options_are_checked_before_sending(run: Run) -> None:
    missing = run(*shlex.split("node plan --gpus H100:1 --max-slowdown 1.05"))
    assert missing.exit_code == 2
    assert "--max-slowdown needs --workload" in missing.stderr
    unknown = run(*shlex.split("node plan --gpus H100:1 --max-slowdown 1.05 --workload mystery"))
    assert unknown.exit_code == 2
    assert "known profiles: compute-bound, inference-batch" in unknown.stderr
    bad_ratio = run(*shlex.split("node plan --gpus H100:1 --max-slowdown 0.5 --workload training"))
    assert bad_ratio.exit_code == 2
    assert "out of range" in bad_ratio.stderr


def test_node_get_unknown_is_not_found(run: Run) -> None:
    result = run("node", "get", "ghost")
    assert result.exit_code == 1
    assert result.stderr.startswith("error: NOT_FOUND: ")


def test_node_hostdev_prints_libvirt_xml_for_a_ready_vfio_node(run: Run, pool: SimPool) -> None:
    ok(run(*shlex.split("node create --gpus H100:2 --vfio --name vm1 --wait -o name")))

    xml = ok(run("node", "hostdev", "vm1"))

    chunks = xml.split("</hostdev>\n")
    assert chunks[-1] == ""  # every element ends its line
    elements = [ElementTree.fromstring(chunk + "</hostdev>") for chunk in chunks[:-1]]
    assert len(elements) == 2
    assert all(e.get("managed") == "no" and e.get("type") == "pci" for e in elements)
    detail = json.loads(ok(run("node", "hostdev", "nodes/vm1", "-o", "json")))
    bound = sorted(d.bdf for d in pool.fabric.devices("h1") if d.driver == "vfio-pci")
    assert sorted(d["bdf"] for d in detail["devices"]) == bound
    assert detail["host"] == "hosts/h1"


def test_node_hostdev_errors_exit_1_with_the_code(run: Run, pool: SimPool) -> None:
    missing = run("node", "hostdev", "ghost")
    assert missing.exit_code == 1
    assert missing.stderr.startswith("error: NOT_FOUND: ")
    ok(run(*shlex.split("node create --gpus H100:1 --name plain --wait -o name")))
    plain = run("node", "hostdev", "plain")
    assert plain.exit_code == 1
    assert plain.stderr.startswith("error: FAILED_PRECONDITION: ")
    assert "--vfio" in plain.stderr
    assert plain.stdout == ""
    usage = run("node", "hostdev")
    assert usage.exit_code == 2


def test_fabric_latency_near_and_far(run: Run, pool: SimPool) -> None:
    near = json.loads(ok(run("fabric", "latency", "--host", "h1", "--box", "box1", "-o", "json")))
    far = json.loads(ok(run("fabric", "latency", "--host", "h1", "--box", "box2", "-o", "json")))
    assert int(near["roundTripNs"]) < int(far["roundTripNs"])
    table = ok(run("fabric", "latency", "--host", "h1", "--box", "box1")).splitlines()
    assert table[0].split() == ["HOST", "BOX", "ROUND-TRIP", "PATH"]


def test_fabric_predict_for_a_box_and_for_a_request(run: Run, pool: SimPool) -> None:
    text = ok(run(*shlex.split("fabric predict --host h1 --box box2 --workload inference-online")))
    lines = text.splitlines()
    assert lines[0] == "host: h1  farthest: box2 at 4.4us (topology model)"
    assert lines[-1].split() == [
        "inference-online",
        "1.088",
        "100",
        "round",
        "trips",
        "per",
        "5ms",
        "step",
    ]
    wide = ok(run(*shlex.split("fabric predict --host h1 --gpus H100:6 -o wide")))
    rows = [line.split() for line in wide.splitlines()]
    assert [
        "box1",
        "4",
        "2.9us",
        "proxy:hosts/h1",
        ">",
        "rack:s1/p1/r1",
        ">",
        "proxy:boxes/box1",
    ] in rows
    assert rows[rows.index(["BOX", "GPUS", "ROUND-TRIP", "PATH"]) + 2][:3] == ["box2", "2", "4.4us"]
    assert "training" in wide and "compute-bound" in wide
    doc = json.loads(ok(run(*shlex.split("fabric predict --host h1 --gpus H100:2 -o json"))))
    assert doc["box"] == "boxes/box1" and doc["latencyModel"] == "topology"


def test_fabric_predict_errors(run: Run, pool: SimPool) -> None:
    unknown = run(*shlex.split("fabric predict --host nope --box box1"))
    assert unknown.exit_code == 1
    assert unknown.stderr.startswith("error: NOT_FOUND: host hosts/nope is not registered")
    missing_box = run(*shlex.split("fabric predict --host h1 --box ghost"))
    assert missing_box.exit_code == 1
    assert missing_box.stderr.startswith("error: NOT_FOUND: box boxes/ghost does not exist")
    both = run(*shlex.split("fabric predict --host h1 --box box1 --gpus 2"))
    assert both.exit_code == 2 and "exactly one of --box and --gpus" in both.stderr
    profile = run(*shlex.split("fabric predict --host h1 --box box1 --workload mystery"))
    assert profile.exit_code == 2 and "known profiles: compute-bound" in profile.stderr
    too_many = run(*shlex.split("fabric predict --host h1 --gpus H100:9"))
    assert too_many.exit_code == 1
    assert too_many.stderr.startswith("error: RESOURCE_EXHAUSTED: ")


def test_host_get_and_gpu_get(run: Run, pool: SimPool) -> None:
    host = yaml.safe_load(ok(run("host", "get", "h1", "-o", "yaml")))
    assert host["name"] == "hosts/h1" and host["alive"] is True and host["slotCapacity"] == 8
    gpu = json.loads(ok(run("gpu", "get", "box2/3", "-o", "json")))
    assert gpu["name"] == "boxes/box2/gpus/3" and gpu["state"] == "GPU_STATE_FREE"


def test_delete_acts_on_every_name_and_reports_each_failure(run: Run) -> None:
    """It used to stop at the first name that failed: `node delete nope real` left the
    real node alone."""
    ok(run(*shlex.split("box add box1 --gpus H100:1 --memory 80GiB")))
    ok(run(*shlex.split("box add box2 --gpus H100:1 --memory 80GiB")))

    result = run("box", "delete", "nope", "box1", "gone", "box2")

    assert result.exit_code == 1
    assert result.stdout == "boxes/box1 deleted\nboxes/box2 deleted\n"
    errors = result.stderr.splitlines()
    assert [line.split(":")[1].strip() for line in errors if line.startswith("error:")] == [
        "boxes/nope",
        "boxes/gone",
    ]
    assert all("NOT_FOUND" in line for line in errors if line.startswith("error:"))
    assert ok(run("box", "list", "-o", "name")) == ""


def test_delete_with_ignore_not_found_skips_missing_names(run: Run) -> None:
    ok(run(*shlex.split("box add box1 --gpus H100:1 --memory 80GiB")))

    result = run("box", "delete", "--ignore-not-found", "nope", "box1")
    assert (result.exit_code, result.stdout, result.stderr) == (0, "boxes/box1 deleted\n", "")
    assert run("node", "delete", "--ignore-not-found", "ghost").exit_code == 0
    missing = run("node", "delete", "ghost")
    assert missing.exit_code == 1 and "error: nodes/ghost: NOT_FOUND" in missing.stderr


def test_status_shows_the_pool_at_a_glance(run: Run, pool: SimPool) -> None:
    table = ok(run("status")).splitlines()
    assert table[0].split() == [
        "MODEL", "TOTAL", "FREE", "IN", "USE", "FENCING", "QUARANTINED", "UNAVAILABLE", "USED"
    ]  # fmt: skip
    assert table[1].split()[0] == "(all)"
    assert any(line.startswith("Fit now") for line in table)
    data = json.loads(ok(run("status", "-o", "json")))
    every = data["models"][0]
    assert every["total"] == every["free"] > 0
    assert [fit["gpus"] for fit in data["fits"]] == [1, 2, 4, 8]


def test_gpu_reclaim_of_a_free_gpu_fails_and_says_why(run: Run, pool: SimPool) -> None:
    result = run("gpu", "reclaim", "box2/3", "--reason", "checked")
    assert result.exit_code == 1
    assert result.stderr.startswith("error: FAILED_PRECONDITION: ")
    assert "is FREE, not QUARANTINED" in result.stderr


def test_gpu_clear_health_marks_a_gpu_healthy_and_refuses_unknown_ones(
    run: Run, pool: SimPool
) -> None:
    assert ok(run("gpu", "clear-health", "box2/3", "--reason", "checked")).strip() == (
        "boxes/box2/gpus/3 healthy"
    )
    missing = run("gpu", "clear-health", "nobox/0")
    assert missing.exit_code == 1
    assert missing.stderr.startswith("error: NOT_FOUND: ")
    assert run("gpu", "clear-health").exit_code == 2  # usage: no GPU named


def test_node_watch_streams_json_lines_until_ctrl_c(
    run: Run, pool: SimPool, broker: BrokerServer
) -> None:
    ok(run("node", "create", "--gpus", "H100:1", "--name", "w1", "--wait"))
    watch = subprocess.Popen(
        [sys.executable, "-m", "dxpool.cli", "--endpoint", broker.endpoint, "node", "watch",
         "w1", "-o", "json"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )  # fmt: skip
    try:
        assert watch.stdout is not None
        first = json.loads(watch.stdout.readline())
        assert first["type"] == "TYPE_EXISTING"
        assert first["node"]["state"] == "NODE_STATE_READY"
        ok(run("node", "delete", "w1"))
        states = []
        while "NODE_STATE_RELEASED" not in states:
            event = json.loads(watch.stdout.readline())
            assert event["type"] == "TYPE_CHANGED"
            states.append(event["node"]["state"])
        assert states[0] == "NODE_STATE_RELEASING"
        watch.send_signal(signal.SIGINT)
        assert watch.wait(timeout=patient(10)) == 130
    finally:
        if watch.poll() is None:
            watch.kill()
            watch.wait()


def test_node_describe_shows_the_node_and_its_events(run: Run, pool: SimPool) -> None:
    ok(run("node", "create", "--gpus", "H100:2", "--name", "d1", "--label", "team=ml", "--wait"))
    ok(run("node", "delete", "d1", "--wait"))
    text = ok(run("node", "describe", "d1"))
    lines = text.splitlines()
    assert lines[0].split() == ["Name:", "d1"]
    assert "State:" in lines[1] and lines[1].split()[-1] == "Released"
    assert any(line.split()[:2] == ["Labels:", "team=ml"] for line in lines)
    assert "Bindings:" in lines and "Events:" in lines
    events = lines[lines.index("Events:") + 1 :]
    assert events[0].split() == ["TYPE", "REASON", "AGE", "OBJECT", "MESSAGE"]
    reasons = [line.split()[1] for line in events[1:]]
    assert reasons[0] == "Composed" and reasons[-2:] == ["Releasing", "Released"]
    assert "Ready" in reasons
    assert all(line.split()[0] == "Normal" for line in events[1:])


def test_node_describe_of_an_unknown_node_is_not_found(run: Run, pool: SimPool) -> None:
    result = run("node", "describe", "nope")
    assert result.exit_code == 1
    assert result.stderr.startswith("error: NOT_FOUND: ")


def test_box_and_host_describe_show_the_events_of_their_nodes(run: Run, pool: SimPool) -> None:
    created = json.loads(ok(run("node", "create", "--gpus", "H100:1", "--name", "d2", "--host",
                                "h1", "--wait", "-o", "json")))  # fmt: skip
    box = created["gpus"][0]["gpu"].split("/")[1]
    box_text = ok(run("box", "describe", box)).splitlines()
    assert box_text[0].split() == ["Name:", box]
    assert any(line.split()[:3] == ["GPUs", "free/total:", "3/4"] for line in box_text)
    events = box_text[box_text.index("Events:") + 2 :]
    assert {line.split()[3] for line in events} == {"node/d2"}
    assert "Ready" in [line.split()[1] for line in events]

    host_text = ok(run("host", "describe", "h1")).splitlines()
    assert any(line.split()[:3] == ["Slots", "used/total:", "1/8"] for line in host_text)
    nodes = host_text[host_text.index("Nodes:") + 1 :]
    assert nodes[1].split()[:3] == ["d2", "Ready", "H100:1"]
    assert "node/d2" in host_text[-1]


def test_list_with_a_label_selector(run: Run, pool: SimPool) -> None:
    ok(run("node", "create", "--gpus", "H100:1", "--name", "s1", "--label", "team=ml"))
    ok(run("node", "create", "--gpus", "H100:1", "--name", "s2", "--label", "team=infra"))
    ok(run("node", "create", "--gpus", "H100:1", "--name", "s3"))
    assert ok(run("node", "list", "-l", "team=ml", "-o", "name")) == "nodes/s1\n"
    assert ok(run("node", "list", "-l", "team!=ml", "-o", "name")).split() == [
        "nodes/s2",
        "nodes/s3",
    ]
    assert ok(run("node", "list", "--selector", "!team", "-o", "name")) == "nodes/s3\n"
    assert ok(run("box", "list", "-l", "row", "-o", "name")) == ""
    assert ok(run("host", "list", "-l", "!row", "-o", "name")) == "hosts/h1\n"


@pytest.mark.parametrize("noun", ["node", "box", "host"])
def test_a_bad_selector_is_a_usage_error(run: Run, noun: str) -> None:
    result = run(noun, "list", "-l", "team=a=b")
    assert result.exit_code == 2
    assert "invalid label selector 'team=a=b'" in result.stderr
    assert "KEY=VALUE, KEY!=VALUE, KEY in (V1,V2)" in result.stderr


def test_box_list_shows_free_of_total(run: Run, pool: SimPool) -> None:
    ok(run("node", "create", "--gpus", "H100:3", "--name", "f1", "--max-latency", "50us",
           "--host", "h1"))  # fmt: skip
    table = ok(run("box", "list")).splitlines()
    assert table[0].split()[:4] == ["NAME", "STATE", "GPUS", "FREE/TOTAL"]
    free = {row.split()[0]: row.split()[2] for row in table[1:]}
    assert sorted(free.values()) in (["1/4", "4/4"], ["2/4", "3/4"])
    host = ok(run("host", "list", "-o", "wide")).splitlines()
    assert host[0].split()[2:4] == ["SLOTS", "USED/TOTAL"]
    assert host[1].split()[2] == "3/8"
    assert "0,1,2" in host[1].split()


def test_node_list_watch_prints_the_table_then_changes_until_ctrl_c(
    run: Run, pool: SimPool, broker: BrokerServer
) -> None:
    ok(run("node", "create", "--gpus", "H100:1", "--name", "w2", "--label", "team=ml", "--wait"))
    ok(run("node", "create", "--gpus", "H100:1", "--name", "w3", "--wait"))
    watch = subprocess.Popen(
        [sys.executable, "-m", "dxpool.cli", "--endpoint", broker.endpoint, "node", "list",
         "-l", "team=ml", "-w"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )  # fmt: skip
    try:
        assert watch.stdout is not None
        assert watch.stdout.readline().split()[:3] == ["NAME", "STATE", "HOST"]
        assert watch.stdout.readline().split()[:2] == ["w2", "Ready"]
        ok(run("node", "delete", "w3", "w2"))
        states = []
        while "Released" not in states:
            row = watch.stdout.readline().split()
            assert row[0] == "w2"  # w3 does not match the selector
            states.append(row[1])
        assert states[0] == "Releasing"
        watch.send_signal(signal.SIGINT)
        assert watch.wait(timeout=patient(10)) == 130
        assert watch.stderr is not None and "Traceback" not in watch.stderr.read()
    finally:
        if watch.poll() is None:
            watch.kill()
            watch.wait()


def test_status_picture_and_its_svg_count_what_etcd_holds(  # type: ignore[no-untyped-def]
    run: Run, pool: SimPool, broker: BrokerServer, etcd_client, key_prefix: str, tmp_path
) -> None:
    ok(run("node", "create", "--gpus", "H100:2", "--name", "p1", "--host", "h1", "--wait"))
    ok(run("box", "cordon", "box2"))
    schema = KeySchema(key_prefix)
    sick = pb.Gpu.FromString(etcd_client.get(schema.gpu("box1", 3))[0])
    if sick.state == pb.GPU_STATE_FREE:  # out of service behind the broker's back
        sick.state = pb.GPU_STATE_QUARANTINED
        etcd_client.put(schema.gpu("box1", 3), sick.SerializeToString())

    def from_etcd() -> dict[str, int]:
        """Each category counted from the stored records, independently of the CLI."""
        boxes = {
            b.name: b.state
            for b in (pb.Box.FromString(v) for v, _ in etcd_client.get_prefix(schema.box("")))
        }
        found: dict[str, int] = {}
        for value, _ in etcd_client.get_prefix(f"{key_prefix}gpus/"):
            gpu = pb.Gpu.FromString(value)
            if gpu.state in (pb.GPU_STATE_QUARANTINED, pb.GPU_STATE_FAULTED):
                key = "failing"
            elif gpu.state == pb.GPU_STATE_FREE:
                key = "free" if boxes[gpu.box] == pb.BOX_STATE_ACTIVE else "unavailable"
            else:
                key = pb.GpuState.Name(gpu.state).removeprefix("GPU_STATE_").lower()
            found[key] = found.get(key, 0) + 1
        return found

    expected = from_etcd()
    assert expected["attached"] == 2 and expected["unavailable"] >= 2
    wait_until(
        lambda: "✖" in ok(run("status", "--picture")).split("\n\n")[0],
        message="the broker to see the quarantined GPU",
    )
    text = ok(run("status", "--picture"))
    assert "rack s1/p1/r1" in text and "rack s1/p1/r2" in text
    assert "cordoned" in text.splitlines()[3]

    svg_path = tmp_path / "pool.svg"
    saved = run("status", "--svg", str(svg_path))
    assert saved.exit_code == 0 and "picture saved to" in saved.stderr
    svg = svg_path.read_text()
    assert from_etcd() == expected  # nothing moved while the picture was taken
    for glyph in picture.GLYPHS:
        assert svg.count(glyph.char) == expected.get(glyph.key, 0) + 1, glyph.key  # + legend


def test_status_picture_flags_that_do_not_go_together_are_usage_errors(run: Run) -> None:
    for args in (["--picture", "-o", "json"], ["--svg", "x.svg", "--watch"]):
        result = run("status", *args)
        assert result.exit_code == 2, args
    assert run("status", "--watch", "--interval", "0s").exit_code == 2


def test_status_svg_to_a_file_that_cannot_be_written_says_so(
    run: Run, pool: SimPool, tmp_path: Path
) -> None:
    result = run("status", "--svg", str(tmp_path / "missing" / "pool.svg"))
    assert result.exit_code == 1
    assert "Could not open file" in result.stderr and "No such file" in result.stderr
    assert "Traceback" not in result.output


def test_status_watch_redraws_until_ctrl_c(broker: BrokerServer, pool: SimPool) -> None:
    watch = subprocess.Popen(
        [sys.executable, "-m", "dxpool.cli", "--endpoint", broker.endpoint, "status",
         "--picture", "--watch", "--interval", "200ms"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )  # fmt: skip
    try:
        assert watch.stdout is not None and watch.stderr is not None
        frames = 0
        while frames < 2:  # to a pipe, each redraw is printed after the last
            line = watch.stdout.readline()
            assert line, "the watch ended early"
            frames += line.startswith("rack s1/p1/r1")
        watch.send_signal(signal.SIGINT)
        assert watch.wait(timeout=patient(10)) == 130
        assert "Traceback" not in watch.stderr.read()
    finally:
        if watch.poll() is None:
            watch.kill()
            watch.wait()


def test_node_plan_with_a_model_set_names_the_model_it_chose(run: Run, pool: SimPool) -> None:
    plan = json.loads(ok(run("node", "plan", "--gpus", "A100|H100:3", "-o", "json")))
    assert plan["host"] == "hosts/h1" and {g["model"] for g in plan["gpus"]} == {"H100"}
    (kept,) = [h for h in plan["hosts"] if h.get("feasible")]
    assert kept["reasons"][0] == "model H100"  # the most free GPUs: the pool has no A100
    mixed = json.loads(
        ok(run("node", "plan", "--gpus", "H100|A100:3", "--mixed-models", "-o", "json"))
    )
    assert mixed["host"] == "hosts/h1"


def test_node_create_with_a_model_set_the_pool_lacks_is_unknown_model(
    run: Run, pool: SimPool
) -> None:
    result = run("node", "create", "--gpus", "B200|A100:1")
    assert result.exit_code == 1
    assert result.stderr.startswith("error: FAILED_PRECONDITION: ")
    assert "no GPU of any model of 'B200|A100' is in the pool" in result.stderr


def test_mixed_models_without_a_model_set_is_a_usage_error(run: Run) -> None:
    result = run("node", "plan", "--gpus", "H100:2", "--mixed-models")
    assert result.exit_code == 2
    assert "--mixed-models needs a model set in --gpus" in result.stderr


def test_node_plan_with_spread_and_affinity(run: Run, pool: SimPool) -> None:
    spread = json.loads(
        ok(run("node", "plan", "--gpus", "H100:2", "--spread", "boxes", "-o", "json"))
    )
    assert sorted(g["gpu"].split("/gpus/")[0] for g in spread["gpus"]) == [
        "boxes/box1",
        "boxes/box2",
    ]
    text = ok(run("node", "plan", "--gpus", "H100:5", "--affinity", "box"))
    assert text.startswith("placement: nothing fits now\n")
    assert "0 in a box holding 5 of them (affinity box)" in text
    refused = run("node", "create", "--gpus", "H100:5", "--affinity", "box")
    assert refused.exit_code == 1
    assert "from one box" in refused.stderr
    # box1 (rack r1) and box2 (rack r2) hold four each: one switch holds at most four
    one_switch = json.loads(
        ok(run("node", "plan", "--gpus", "H100:4", "--affinity", "switch", "-o", "json"))
    )
    assert {g["gpu"].split("/gpus/")[0] for g in one_switch["gpus"]} == {"boxes/box1"}
    text = ok(run("node", "plan", "--gpus", "H100:2", "--affinity", "switch", "--spread", "boxes"))
    assert text.startswith("placement: nothing fits now\n")
    assert "at most 1 free H100 under one rack switch" in text
    refused = run("node", "create", "--gpus", "H100:5", "--affinity", "switch")
    assert refused.exit_code == 1
    assert "from one rack switch" in refused.stderr


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("--spread", "racks"), "cannot parse spread 'racks'"),
        (("--spread", "boxes:0"), "out of range"),
        (("--affinity", "box", "--spread", "boxes"), "give one or the other"),
        (("--affinity", "rack"), "'rack' is not one of 'box', 'switch'"),
    ],
)
def test_bad_spread_or_affinity_is_a_usage_error(
    run: Run, args: tuple[str, ...], message: str
) -> None:
    result = run("node", "plan", "--gpus", "H100:2", *args)
    assert result.exit_code == 2
    assert message in result.stderr


def test_node_plan_with_a_host_selector_uses_the_agents_labels(
    run: Run, broker: BrokerServer, pool: SimPool
) -> None:
    pool.start_agent("h2", rack="r2", extra=("--label", "env=prod"))
    with Client(broker.endpoint) as client:
        wait_until(lambda: sum(h.alive for h in client.list_hosts()) == 2, message="h2 alive")
    plan = json.loads(
        ok(run("node", "plan", "--gpus", "H100:2", "--host-selector", "env=prod", "-o", "json"))
    )
    assert plan["host"] == "hosts/h2"
    (h1,) = [h for h in plan["hosts"] if h["name"] == "hosts/h1"]
    assert h1["reasons"] == ["labels lack env=prod"]
    refused = run("node", "create", "--gpus", "H100:2", "--host-selector", "env=dev")
    assert refused.exit_code == 1
    assert "on hosts labelled env=dev" in refused.stderr
    assert "host labels: 2 of 2 hosts do not have env=dev" in refused.stderr
    bad = run("node", "plan", "--gpus", "H100:2", "--host-selector", "env")
    assert bad.exit_code == 2


def test_node_plan_with_excluded_hosts_goes_elsewhere(
    run: Run, broker: BrokerServer, pool: SimPool
) -> None:
    pool.start_agent("h2", rack="r2")
    with Client(broker.endpoint) as client:
        wait_until(lambda: sum(h.alive for h in client.list_hosts()) == 2, message="h2 alive")
    plan = json.loads(
        ok(run("node", "plan", "--gpus", "H100:2", "--exclude-host", "h1", "-o", "json"))
    )
    assert plan["host"] == "hosts/h2"
    (h1,) = [h for h in plan["hosts"] if h["name"] == "hosts/h1"]
    assert h1["reasons"] == ["excluded by the request"]
    both = ("--exclude-host", "h1", "--exclude-host", "hosts/h2")
    refused = run("node", "create", "--gpus", "H100:2", *both)
    assert refused.exit_code == 1
    assert "hosts: 2 of 2 excluded by the request" in refused.stderr
    assert run("node", "plan", "--gpus", "H100:2", "--exclude-host", "h 1").exit_code == 2


def test_node_plan_with_cpus_and_host_memory(run: Run, broker: BrokerServer, pool: SimPool) -> None:
    pool.start_agent("h2", rack="r2", extra=("--cpus", "16", "--memory", "128GiB"))
    with Client(broker.endpoint) as client:
        wait_until(lambda: sum(h.alive for h in client.list_hosts()) == 2, message="h2 alive")
    args = ("--gpus", "H100:2", "--cpus", "8", "--host-memory", "64GiB")
    plan = json.loads(ok(run("node", "plan", *args, "-o", "json")))
    assert plan["host"] == "hosts/h2"
    (h1,) = [h for h in plan["hosts"] if h["name"] == "hosts/h1"]
    assert h1["reasons"] == ["declares no CPU cores; declares no memory"]
    text = ok(run("node", "plan", "--gpus", "H100:2", "--cpus", "17"))
    assert "host resources: 2 of 2 hosts lack 17 free CPU cores" in text
    assert run("node", "plan", "--gpus", "H100:2", "--host-memory", "lots").exit_code == 2


def test_node_delete_wait_releases_every_node_before_waiting_for_any(
    run: Run, broker: BrokerServer, stubs: Stubs, sim_pool: SimPool
) -> None:
    """Each detach takes seconds (the proxy's map delay): the second node's release is
    committed while the first is still detaching, so the waits overlap."""
    register_sim_box(sim_pool, stubs, "box1", gpus=4)
    sim_pool.start_agent("h1", map_delay_s=2.0)
    with Client(broker.endpoint) as client:
        wait_until(lambda: any(h.alive for h in client.list_hosts()), 60, message="h1 alive")
        for name in ("d1", "d2"):
            ok(run("node", "create", "--gpus", "H100:1", "--name", name))
        for name in ("d1", "d2"):
            client.wait_for_node(name, timeout_s=120)
        order: list[tuple[str, str]] = []
        events = client.watch_nodes()

        def follow() -> None:
            released = {("nodes/d1", "NODE_STATE_RELEASED"), ("nodes/d2", "NODE_STATE_RELEASED")}
            for event in events:
                order.append((event.node.name, pb.NodeState.Name(event.node.state)))
                if released <= set(order):
                    return

        follower = threading.Thread(target=follow, daemon=True)
        follower.start()
        deleted = run("node", "delete", "d1", "d2", "--wait")
        assert ok(deleted) == "nodes/d1 released\nnodes/d2 released\n"
        assert "waiting up to 120s for 2 nodes to be RELEASED" in deleted.stderr
        follower.join(60)
    changes = [
        entry for entry in order if entry[1] in ("NODE_STATE_RELEASING", "NODE_STATE_RELEASED")
    ]
    assert changes.index(("nodes/d2", "NODE_STATE_RELEASING")) < changes.index(
        ("nodes/d1", "NODE_STATE_RELEASED")
    ), changes


def test_node_delete_by_label_selector_and_dry_run(run: Run, pool: SimPool) -> None:
    for name, team in (("s1", "ml"), ("s2", "infra"), ("s3", "ml")):
        ok(run("node", "create", "--gpus", "H100:1", "--name", name, "--label", f"team={team}"))
    dry = ok(run("node", "delete", "-l", "team in (ml)", "--dry-run"))
    assert dry == "nodes/s1 would be released (dry run)\nnodes/s3 would be released (dry run)\n"
    assert ok(run("node", "list", "-o", "name")) == "nodes/s1\nnodes/s2\nnodes/s3\n"
    assert ok(run("node", "delete", "-l", "team=ml", "--wait")).splitlines() == [
        "nodes/s1 released",
        "nodes/s3 released",
    ]
    assert ok(run("node", "list", "-o", "name")) == "nodes/s2\n"
    nothing = run("node", "delete", "-l", "team=nobody")
    assert ok(nothing) == "" and "no nodes match team=nobody" in nothing.stderr
    both = run("node", "delete", "s2", "-l", "team=infra")
    assert both.exit_code == 2 and "not both" in both.stderr


def test_ctrl_c_during_create_wait_says_the_node_goes_on(
    run: Run, pool: SimPool, monkeypatch: pytest.MonkeyPatch
) -> None:
    def interrupted(*args: object, **kwargs: object) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(Client, "wait_for_node", interrupted)
    result = run("node", "create", "--gpus", "H100:1", "--name", "c1", "--wait")
    assert result.exit_code == 130
    assert "interrupted: stopped waiting; nodes/c1 is still being attached" in result.stderr
    assert "`dxpool node get c1`" in result.stderr and "`dxpool node delete c1`" in result.stderr
    assert ok(run("node", "list", "-o", "name")) == "nodes/c1\n"


def test_jsonpath_custom_columns_sort_by_and_no_headers(run: Run, pool: SimPool) -> None:
    for name, count in (("j2", "2"), ("j1", "1"), ("j3", "3")):
        ok(run("node", "create", "--gpus", f"H100:{count}", "--name", name, "--label", "t=x"))
    names = ok(run("node", "list", "-o", "jsonpath={.items[*].name}", "--sort-by", ".name"))
    assert names == "nodes/j1 nodes/j2 nodes/j3\n"
    template = 'jsonpath={range .items[*]}{.name}{"\\t"}{.spec.gpus.count}{"\\n"}{end}'
    ranged = ok(run("node", "list", "--sort-by", ".spec.gpus.count", "-o", template))
    assert ranged == "nodes/j1\t1\nnodes/j2\t2\nnodes/j3\t3\n\n"
    one = ok(run("node", "get", "j2", "-o", "jsonpath={.spec.labels.t}"))
    assert one == "x\n"
    filtered = ok(run("node", "list", "-o", "jsonpath={.items[?(@.spec.gpus.count==3)].name}"))
    assert filtered == "nodes/j3\n"
    columns = ok(run("node", "list", "--sort-by", ".name", "-o",
                     "custom-columns=NAME:.name,GPUS:.gpus[*].gpu,NONE:.nothing"))  # fmt: skip
    lines = columns.splitlines()
    assert lines[0].split() == ["NAME", "GPUS", "NONE"]
    assert [line.split()[0] for line in lines[1:]] == ["nodes/j1", "nodes/j2", "nodes/j3"]
    assert lines[1].split()[2] == "<none>" and lines[3].split()[1].count(",") == 2
    bare = ok(run("node", "list", "--no-headers", "--sort-by", ".name")).splitlines()
    assert [line.split()[0] for line in bare] == ["j1", "j2", "j3"]


@pytest.mark.parametrize(
    "args",
    [
        ["-o", "jsonpath={range .items[*]}{.name}"],
        ["-o", "jsonpath={.items[}"],
        ["-o", "custom-columns=NAME"],
        ["-o", "yamll"],
        ["--sort-by", ".items["],
        ["-w", "-o", "jsonpath={.name}"],
    ],
)
def test_a_bad_template_is_a_usage_error_before_any_call(args: list[str]) -> None:
    result = CliRunner().invoke(cli, ["--endpoint", "127.0.0.1:1", "node", "list", *args])
    assert result.exit_code == 2, result.output
    assert "error" in result.stderr.lower() and "UNAVAILABLE" not in result.stderr


def test_tab_completion_offers_the_brokers_names(run: Run, broker: BrokerServer) -> None:
    for box in ("rack1-a", "rack1-b", "rack2-a"):
        ok(run(*shlex.split(f"box add {box} --gpus H100:2 --memory 80GiB")))

    def complete(words: str) -> list[str]:
        answer = subprocess.run(
            [sys.executable, "-m", "dxpool.cli"],
            env={**os.environ, "_DXPOOL_COMPLETE": "bash_complete",
                 "COMP_WORDS": f"dxpool --endpoint {broker.endpoint} {words}",
                 "COMP_CWORD": str(len(words.split()) + 3 - (not words.endswith(" ")))},
            capture_output=True,
            text=True,
            timeout=patient(60),
            check=True,
        )  # fmt: skip
        return [line.split(",", 1)[1] for line in answer.stdout.splitlines()]

    assert complete("box delete rack1") == ["rack1-a", "rack1-b"]
    assert complete("box get ") == ["rack1-a", "rack1-b", "rack2-a"]
    assert complete("gpu get rack2-a/") == ["rack2-a/0", "rack2-a/1"]


def test_one_grammar_with_the_pools_spelling_and_errors_that_echo_the_request(
    run: Run, pool: SimPool
) -> None:
    # a box whose model is spelled otherwise joins the pool's spelling
    ok(run(*shlex.split("box add box9 --gpus h100:2 --memory 80GiB")))
    models = {g["model"] for g in json.loads(ok(run("gpu", "list", "-o", "json")))}
    assert models == {"H100"}
    # a request in lower case composes, and is listed as the pool spells it
    ok(run(*shlex.split("node create --gpus h100:2 --name lc")))
    assert ok(run("node", "list")).splitlines()[1].split()[3] == "H100:2"
    # MODEL-COUNT reads as a model name (dashes are common in them): the error says so
    dashed = run(*shlex.split("node create --gpus H100-4"))
    assert dashed.exit_code == 1
    assert "no GPU of model 'H100-4' is in the pool; did you mean H100:4 (MODEL:COUNT)?" in (
        dashed.stderr
    )
    # a model without a count is one GPU, said out loud (an unquoted set is cut at '|')
    single = run(*shlex.split("node create --gpus H100 --name one"))
    assert "warning: --gpus H100 is a model without a count: one GPU (H100:1)" in single.stderr
    assert "quote a model set: --gpus 'H100|A100:4'" in single.stderr
    assert json.loads(ok(run("node", "get", "one", "-o", "json")))["spec"]["gpus"]["count"] == 1


def test_node_create_dry_run_tells_where_and_creates_nothing(run: Run, pool: SimPool) -> None:
    planned = ok(run("node", "create", "--gpus", "H100:2", "--name", "dr", "--dry-run"))
    assert planned.startswith("nodes/dr would be created on h1 with box")
    assert planned.rstrip().endswith("(dry run)")
    assert ok(run("node", "list", "-a", "-o", "name")) == ""
    too_big = run("node", "create", "--gpus", "H100:64", "--dry-run")
    assert too_big.exit_code == 1
    assert "would not be created now" in too_big.stderr
    # The dry run plans the request create would send, the hosts it excludes included.
    excluded = run("node", "create", "--gpus", "H100:1", "--exclude-host", "h1", "--dry-run")
    assert excluded.exit_code == 1, excluded.output
    assert "would not be created now" in excluded.stderr
