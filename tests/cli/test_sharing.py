"""The CLI of the queue, loaning and maintenance against a real broker, etcd and a host
agent: ``node create --queue``, ``queue list``, ``describe``, ``tenant set-quota
--guaranteed``, ``host cordon|drain|uncordon``, ``box drain``, ``status``."""

from __future__ import annotations

import json
import shlex

from dxpool.client import Client
from tests.cli.test_commands import Run, ok, pool, run  # noqa: F401  (fixtures)
from tests.conftest import SimPool, wait_until


def test_a_queued_node_is_listed_described_and_placed_once_capacity_frees(
    run: Run,  # noqa: F811
    pool: SimPool,  # noqa: F811
) -> None:
    held = json.loads(ok(run(*shlex.split("node create --gpus H100:8 --name big -o json"))))
    assert held["state"] == "NODE_STATE_PENDING"
    queued = run(*shlex.split("node create --gpus H100:2 --name waiter --queue --priority 5"))
    assert "nodes/waiter queued:" in ok(queued) or "nodes/waiter queued:" in queued.stderr
    listed = ok(run("queue", "list")).splitlines()
    assert listed[0].split()[:5] == ["POSITION", "NAME", "TENANT", "PRIORITY", "GPUS"]
    assert listed[1].split()[:5] == ["1", "waiter", "<none>", "5", "2"]
    described = ok(run("node", "describe", "waiter"))
    assert "Queue:" in described and "position 1" in described
    assert "Waiting for:" in described and "Priority:" in described
    assert "Queue:  1 waiting" in ok(run("status"))
    ok(run("node", "delete", "big"))
    wait_until(
        lambda: "Ready" in ok(run("node", "get", "waiter")), 60, message="the queued node READY"
    )
    assert ok(run("queue", "list")).strip() == "the queue is empty"


def test_queue_flags_are_checked_before_sending(run: Run) -> None:  # noqa: F811
    assert run(*shlex.split("node create --gpus H100:1 --queue-timeout 5m")).exit_code == 2
    assert run(*shlex.split("node create --gpus H100:1 --priority 5000")).exit_code == 2


def test_tenant_guarantee_and_borrowing_show_in_the_tenant_table(
    run: Run,  # noqa: F811
    pool: SimPool,  # noqa: F811
) -> None:
    ok(run(*shlex.split("tenant set-quota team-a --guaranteed 2 --borrow-limit 4")))
    ok(run(*shlex.split("node create --gpus H100:2 --tenant team-a")))
    args = "node create --gpus H100:3 --tenant team-a -o json"
    borrowed = json.loads(ok(run(*shlex.split(args))))
    assert borrowed["preemptible"] is True
    table = ok(run("tenant", "show", "team-a", "-o", "wide"))
    assert "2/2 +3/4" in table
    over = run(*shlex.split("node create --gpus H100:2 --tenant team-a"))
    assert over.exit_code == 1 and "borrow_limit" in over.stderr
    assert run(*shlex.split("tenant set-quota team-b --borrow-limit 2")).exit_code == 2


def test_host_cordon_drain_uncordon(
    run: Run,  # noqa: F811
    pool: SimPool,  # noqa: F811
) -> None:
    assert ok(run("host", "cordon", "h1", "--reason", "fan")).strip() == "hosts/h1 cordoned"
    described = ok(run("host", "describe", "h1"))
    assert "Cordoned:" in described and "yes (fan)" in described
    refused = run(*shlex.split("node create --gpus H100:1"))
    assert refused.exit_code == 1 and "RESOURCE_EXHAUSTED" in refused.stderr
    ok(run("host", "uncordon", "h1"))
    ok(run(*shlex.split("node create --gpus H100:1 --preemption-grace 0s --name n1 --wait")))
    drained = run("host", "drain", "h1", "--wait", "--timeout", "60s", "-o", "json")
    host = json.loads(ok(drained))
    assert host["drain"]["state"] == "DRAIN_STATE_DRAINED"
    assert "hosts/h1: Draining, 1 nodes and 1 GPUs left" in drained.stderr
    state = json.loads(ok(run("node", "get", "n1", "-o", "json")))["state"]
    assert state in ("NODE_STATE_RELEASING", "NODE_STATE_RELEASED")
    assert run("host", "cordon", "nope").exit_code == 1
    ok(run("host", "uncordon", "h1"))


def test_box_drain_moves_gpus_and_reports_progress(
    run: Run,  # noqa: F811
    pool: SimPool,  # noqa: F811
    broker: object,
) -> None:
    ok(run("box", "cordon", "box2"))
    ok(run(*shlex.split("node create --gpus H100:2 --name mover --wait")))
    ok(run("box", "uncordon", "box2"))
    drained = run("box", "drain", "box1", "--wait", "--timeout", "90s", "-o", "json")
    box = json.loads(ok(drained))
    assert box["drain"]["state"] == "DRAIN_STATE_DRAINED"
    with Client(broker.endpoint) as client:  # type: ignore[attr-defined]
        node = client.get_node("mover")
    assert {b.gpu.split("/")[1] for b in node.gpus} == {"box2"}
    assert "Drain:" in ok(run("box", "describe", "box1"))
